"""`vllm serve --hook-manager graphtap`: steering over the OpenAI API (vllm_xargs), and
the CLI flags themselves. One server for the module."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from graphtap.testing.engines import _hf_model, tokenize
from graphtap.testing.hf_reference import hf_generate
from steer_parity import vector

HOOKS = {"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "scale": 6.0,
                    "vector": vector(256, 3)}]}


def test_cli_flags_reach_the_engine_config():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--hook-manager", "graphtap", "--hook-config",
                              '{"sites": ["blocks.*.hook_resid_post"], "max_vectors": 8}'])
    ea = EngineArgs.from_cli_args(args)
    assert ea.hook_manager == "graphtap" and ea.hook_config["max_vectors"] == 8


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(llama_path, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(llama_path),
           "--host", "127.0.0.1", "--port", str(port), "--hook-manager", "graphtap",
           "--hook-config", '{"sites": ["blocks.*.hook_resid_post"]}', "--enforce-eager",
           "--dtype", "float32", "--gpu-memory-utilization", "0.3", "--max-model-len", "512",
           "--served-model-name", "m"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"server exited:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail(f"server did not start:\n{log.read_text()[-4000:]}")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def completion(base, ids, hooks=None):
    body = {"model": "m", "prompt": ids, "max_tokens": 12, "temperature": 0.0,
            "return_token_ids": True}
    if hooks is not None:
        body["vllm_xargs"] = {"hooks": json.dumps(hooks)}
    return post(base + "/v1/completions", body)


def test_steering_over_http_matches_hf(server, llama_path):
    ids = tokenize(llama_path, ["Prompt injection asks a model to ignore"])[0]
    models = json.loads(urllib.request.urlopen(server + "/v1/models").read())["data"]
    assert models
    status, plain = completion(server, ids)
    status2, steered = completion(server, ids, HOOKS)
    assert status == status2 == 200, (plain, steered)
    hf = _hf_model(str(llama_path))
    assert plain["choices"][0]["token_ids"] == hf_generate(hf, ids, 12)[0]
    assert steered["choices"][0]["token_ids"] == hf_generate(hf, ids, 12, HOOKS)[0]
    assert steered["choices"][0]["token_ids"] != plain["choices"][0]["token_ids"]


def test_bad_spec_over_http_is_a_400_naming_the_field(server, llama_path):
    ids = tokenize(llama_path, ["Numbers like 12, 40"])[0]
    bad = {"steer": [{"site": "blocks.1.hook_resid_mid", "op": "add", "vector": [1.0] * 256}]}
    status, body = completion(server, ids, bad)
    assert status == 400, body
    assert "hooks.steer[0].site" in json.dumps(body) and "hook_config.sites" in json.dumps(body)
    status, _ = completion(server, ids)
    assert status == 200
