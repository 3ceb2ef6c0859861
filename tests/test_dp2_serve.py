"""Data parallelism (issue 19): `graphtap serve --data-parallel-size 2` on vLLM's CPU build,
two engine replicas bound one core each, one server. Each replica has its own hook
manager (engine-scoped state); vLLM's DP coordinator spreads requests over both. Steered
and capturing requests served by either replica give the same tokens, their captures
come back whole and equal HF's residual stream, and both replicas served some."""
import concurrent.futures as cf
import os
import re

import httpx
import pytest
import torch
from graphtap.testing.engines import _hf_model, tokenize
from graphtap.testing.hf_reference import hf_capture
from graphtap.wire import decode
from helpers import vector, vllm_server

KEY = "dp-key"
PROMPT = "Steering vectors shift the hidden state"
SITE = "blocks.1.hook_resid_post"
BIND = "VLLM_CPU_OMP_THREADS_BIND"


@pytest.fixture(scope="module")
def server(llama_path, tmp_path_factory):
    before = os.environ.get(BIND)
    os.environ[BIND] = "0|1"  # one core per replica (the CPU build refuses otherwise)
    try:
        with vllm_server(llama_path, ["--data-parallel-size", "2", "--enforce-eager",
                                      "--max-model-len", "256", "--dtype", "float32",
                                      "--gpu-memory-utilization", "0.15", "--api-key", KEY],
                         tmp_path_factory.mktemp("dp") / "server.log",
                         graphtap_cli=True) as base:
            yield base
    finally:
        if before is None:
            os.environ.pop(BIND, None)
        else:
            os.environ[BIND] = before


def test_both_replicas_steer_and_capture_alike(server, llama_path):
    headers = {"Authorization": f"Bearer {KEY}"}
    model = httpx.get(server + "/v1/models", headers=headers).json()["data"][0]["id"]
    steer = {"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "scale": 8.0,
                        "vector": vector(256, 3)}]}
    spec = {**steer, "capture": [{"site": SITE, "dtype": "float32"}]}

    def complete(hooks):
        body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, **({"hooks": hooks} if hooks else {})}
        r = httpx.post(server + "/v1/completions", json=body, headers=headers, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    with cf.ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(complete, [spec] * 8 + [None] * 4))
    steered, plain = [o["text"] for o in outs[:8]], [o["text"] for o in outs[8:]]
    assert len(set(steered)) == 1 and len(set(plain)) == 1 and steered[0] != plain[0]
    ids = tokenize(llama_path, [PROMPT])[0]
    want, wpos, _ = hf_capture(_hf_model(str(llama_path)), ids, 8, [SITE], steer)
    for o in outs[:8]:
        hooks = decode(o["hooks"], as_torch=True)
        assert hooks.error is None
        assert hooks.positions[SITE].tolist() == wpos[SITE].tolist()
        torch.testing.assert_close(hooks[SITE], want[SITE], rtol=1e-4, atol=1e-4)
    metrics = httpx.get(server + "/metrics", headers=headers).text
    served = {}
    for engine, n in re.findall(
            r'vllm:request_success_total\{engine="(\d)",finished_reason="length"[^}]*\} (\S+)',
            metrics):
        served[engine] = served.get(engine, 0) + float(n)
    assert served.get("0", 0) > 0 and served.get("1", 0) > 0, served  # both replicas served
