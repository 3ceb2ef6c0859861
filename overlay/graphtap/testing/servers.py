"""A `vllm serve` (or `graphtap serve`) process on a loopback port, for the tests and the
serve benchmark: started, waited for until /health answers, stopped on exit."""
from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class ServerFailed(RuntimeError):
    """The server exited or did not answer /health in time; the message ends with its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(cmd: list[str], port: int, env: dict, log_path: Path,
                   start_timeout: float = 300) -> Iterator[str]:
    """Run `cmd` (which serves on 127.0.0.1:`port`), logging to `log_path`; yield its base
    URL once /health answers 200."""
    log_path = Path(log_path)
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise ServerFailed(f"server exited:\n{log_path.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise ServerFailed(f"server did not start:\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
