"""A request's `save_to` file, written in the frontend process when the request finishes.

Whatever happens here fails this request's save only (HookOutputs.save_error; its
captures still come back): an exception in AsyncLLM's output handler stops the whole
API server. The folder is walked one name at a time from save_root's descriptor with
O_NOFOLLOW, so no symlink (planted before or during the walk) leads outside it; the
file is written under a temporary name and renamed, so a reader never sees half of
one; and a server writes at most its quota of bytes in its lifetime.
"""
from __future__ import annotations

import errno
import hashlib
import os
import secrets
import threading

from graphtap.outputs import HookOutputs

NAME_CHARS = 96  # of a request id kept in its file name (then a hash of the whole id)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def file_name(request_id: str) -> str:
    """<request id, made safe and cut short>-<hash of the id>.safetensors: unique per
    id, valid on every filesystem (at most ~120 bytes)."""
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_"
                   for c in request_id[:NAME_CHARS]).lstrip(".") or "request"
    digest = hashlib.sha256(request_id.encode()).hexdigest()[:12]
    return f"{safe}-{digest}.safetensors"


class Saver:
    """One per frontend: its root, its quota and the bytes written so far."""

    def __init__(self, root: str | None, quota_bytes: int):
        self.root, self.quota = root, quota_bytes
        self.written = 0
        self._lock = threading.Lock()

    def save(self, relative: str, request_id: str, out: HookOutputs) -> None:
        """Writes the file and sets out.saved_to, or sets out.save_error."""
        from safetensors.torch import save

        try:
            data = save({**out, **{f"{k}.positions": v for k, v in out.positions.items()}})
            with self._lock:
                if self.written + len(data) > self.quota:
                    raise _Refused(f"the server's save quota of {self.quota} bytes "
                                   f"(hook_config.save_quota_bytes) is spent "
                                   f"({self.written} written)")
                self.written += len(data)
            try:
                name = file_name(request_id)
                self._write(relative, name, data)
            except BaseException:
                with self._lock:
                    self.written -= len(data)
                raise
            out.saved_to = f"{relative}/{name}"
        except _Refused as e:
            out.save_error = f"hooks.save_to: not saved: {e}"
        except OSError as e:
            out.save_error = (f"hooks.save_to: not saved: {os.strerror(e.errno) if e.errno else e}"
                              f"{' (a symlink or a file on the way)' if e.errno in _NOT_A_DIR else ''}")
        except Exception as e:  # never the server's end (see the module's docstring)
            out.save_error = f"hooks.save_to: not saved: {type(e).__name__}: {e}"

    def _write(self, relative: str, name: str, data: bytes) -> None:
        if self.root is None:
            raise _Refused("this engine has no hook_config.save_root")
        fd = os.open(self.root, DIR_FLAGS & ~os.O_NOFOLLOW)  # the root itself may be a link
        try:
            for part in relative.split("/"):
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
            tmp = f".{name}.{secrets.token_hex(4)}.tmp"
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644,
                          dir_fd=fd)
            try:
                with os.fdopen(out, "wb") as f:
                    f.write(data)
                os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=fd)
                except OSError:
                    pass
                raise
        finally:
            os.close(fd)


class _Refused(Exception):
    pass


_NOT_A_DIR = (errno.ENOTDIR, errno.ELOOP)
