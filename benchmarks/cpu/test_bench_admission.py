"""CPU benchmark of a burst's admission the way AsyncLLM runs it (issue 18): raw prompts
are processed one by one on one worker thread (the renderer's executor), and the event
loop sends each processed request to the engine core. Pure-Python spec work on that
thread kept the GIL across requests, so the loop sent a burst's first requests only at
the interpreter's 5 ms switch interval: on the H200, 64 capture requests reached the
engine core 5-20 ms after steer ones, whose vector hashing releases the GIL.

64 requests capturing 3 residual sites go through SamplingParams.clone and the hook
frontend's processing, `process_request` (which yields the GIL first off the main
thread) or, as the control, the same work without the yield (`_process`). extra_info:
when the event loop saw the first and the 32nd request processed (when AsyncLLM would
send them), median over rounds, in ms. What it shows depends on the host: on the 2-core
dev machine the loop sees the first request at ~1 ms either way and each yield costs a
thread switch (~90 us: the burst 8 -> 14 ms); the H200 host's convoy (request 0 queued
at 8-29 ms without the yield, 2.4-5.3 with it; benchmarks/results, llama3-8b-ttft) does
not show here."""
import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from vllm import SamplingParams

from graphtap.frontend import GraphtapFrontend
from graphtap.spec import ModelShape

SITES = [f"blocks.{layer}.hook_resid_post" for layer in (8, 16, 24)]
SHAPE = ModelShape(num_layers=32, hidden_size=4096, max_model_len=512,
                   configured_sites=set(SITES), max_steers=4, max_vectors=64,
                   max_captures=4, num_heads=32, num_kv_heads=8, head_dim=128,
                   save_root=None)
HS = {"capture": [{"site": s, "positions": "last_prompt"} for s in SITES]}


async def burst(process, n: int = 64) -> list[float]:
    """ms from the burst's start until the event loop saw each request processed."""
    executor = ThreadPoolExecutor(1)
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    seen: list[float] = []

    async def one(i: int) -> None:
        await loop.run_in_executor(executor, process, i)
        seen.append((time.perf_counter() - t0) * 1e3)

    await asyncio.gather(*(one(i) for i in range(n)))
    executor.shutdown()
    return sorted(seen)


@pytest.mark.parametrize("path", ["process_request", "control"])
def test_admission_burst(benchmark, path):
    frontend = GraphtapFrontend(SHAPE)
    params = SamplingParams(max_tokens=8, hooks=HS)

    def process(i: int) -> None:
        p = params.clone()  # as InputProcessor.process_inputs does
        if path == "control":
            frontend._process(p, None, 256)
        else:
            frontend.process_request(f"r{i}", p, None, 256)
        assert p.hooks is not None

    runs: list[list[float]] = []
    benchmark.pedantic(lambda: runs.append(asyncio.run(burst(process))), rounds=20)
    benchmark.extra_info["first_seen_ms"] = round(statistics.median(r[0] for r in runs), 3)
    benchmark.extra_info["32nd_seen_ms"] = round(statistics.median(r[31] for r in runs), 3)
    assert all(len(r) == 64 for r in runs)


QK = {"capture": [c for layer in (4, 8, 16, 24) for c in (
    {"site": f"blocks.{layer}.attn.hook_q", "positions": "last_prompt", "heads": [0, 1, 2, 3]},
    {"site": f"blocks.{layer}.attn.hook_k", "positions": "prompt", "heads": [0, 1, 2, 3]})]}
# Llama-3-8B with bench_tpot's sites: hs's 3 residual sites and qk's q and k at 4 layers
WIDE = ModelShape(num_layers=32, hidden_size=4096, max_model_len=512,
                  configured_sites={*SITES, *(e["site"] for e in QK["capture"])},
                  max_steers=4, max_vectors=64, max_captures=16, num_heads=32,
                  num_kv_heads=8, head_dim=128, save_root=None)


def bench_hooks(spec: str):
    """The hooks of a benchmark's spec: plain (none), hs, qk, or steering with a
    4096-float vector as a JSON list (steer-list), packed (steer-b64) or a numpy array
    (steer-numpy: an in-process caller's, bench_tpot's)."""
    import base64

    import numpy as np

    if spec in ("plain", "hs", "qk"):
        return {"plain": None, "hs": HS, "qk": QK}[spec]
    vec = np.random.default_rng(0).normal(size=4096).astype("<f4")
    vector = vec.tolist() if spec == "steer-list" else vec if spec == "steer-numpy" else \
        {"b64": base64.b64encode(vec).decode()}
    return {"steer": [{"site": SITES[1], "op": "add", "vector": vector, "positions": "all"}]}


@pytest.mark.parametrize("spec", ["hs", "qk", "steer-list", "steer-b64", "steer-numpy"])
def test_remembered_spec(benchmark, spec):
    """One request's frontend admission once its spec is remembered (a deployment's
    guard or steering spec, the same in every request): SamplingParams.clone, then
    process_request, which keys the cache by the spec's text after checking that it is
    made of JSON's types only (or numpy arrays, keyed by their bytes). steer-list: a
    4096-float vector as a JSON list (that check walks every float), steer-b64: the same
    vector packed, steer-numpy: as a numpy array (bench_tpot's)."""
    frontend = GraphtapFrontend(WIDE)
    params = SamplingParams(max_tokens=8, hooks=bench_hooks(spec))

    def admit():
        p = params.clone()
        frontend.process_request("r", p, None, 256)
        return p

    assert benchmark(admit).hooks is not None


@pytest.mark.parametrize("spec", ["plain", "hs", "qk", "steer-b64"])
def test_engine_core_decode(benchmark, spec):
    """What the engine core's input thread does per request before the scheduler sees
    it: decode the EngineCoreRequest off its socket and build vLLM's Request. That
    thread runs beside the step in flight, which waits for the GIL meanwhile: a burst's
    first step, which the rest of the burst waits for, grows with the requests that
    arrive during it. A spec travels as one bytes value (NormalisedSpec.to_wire)."""
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    params = SamplingParams(max_tokens=8, hooks=bench_hooks(spec))
    salt = GraphtapFrontend(WIDE).process_request("r", params, None, 256)
    request = EngineCoreRequest(
        request_id="r", prompt_token_ids=list(range(100, 356)), mm_features=None,
        sampling_params=params, pooling_params=None, arrival_time=0.0, lora_request=None,
        cache_salt=salt, data_parallel_rank=None)
    frames = MsgpackEncoder().encode(request)
    decoder = MsgpackDecoder(EngineCoreRequest)

    def arrive():
        return Request.from_engine_core_request(decoder.decode(frames), None)

    assert (benchmark(arrive).sampling_params.hooks is None) == (spec == "plain")


@pytest.mark.parametrize("spec", ["plain", "hs", "qk"])
def test_admit_request(benchmark, spec):
    """The frontend's admission of a request the output processor adds (admit_request:
    its spec read back from the wire form, the resident-vector and live-capture budgets
    checked and taken), then its release, untimed; per request, on the API server's
    event loop, which sends the burst's later requests meanwhile."""
    from types import SimpleNamespace as NS

    frontend = GraphtapFrontend(WIDE)
    params = SamplingParams(max_tokens=8, hooks=bench_hooks(spec))
    frontend.process_request("r", params, None, 256)
    request = NS(request_id="r", sampling_params=params, prompt_token_ids=[0] * 256)

    def released():
        frontend.release_request("r")
        return (request,), {}

    benchmark.pedantic(frontend.admit_request, setup=released, rounds=2000)
    assert frontend.stats()["requests_capturing"] == (spec != "plain")
