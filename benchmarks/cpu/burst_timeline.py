"""The hook manager's phase calls over bursts of 64 requests on the CPU engine (issue 18):
graphtap's host path where it really runs, between vLLM's steps, not in a hot loop.

A phase costs several times here what the same call costs when repeated in a loop
(benchmarks/cpu/test_bench_delivery.py): a small capture step's per_request ~0.3 ms a
step here against ~0.07 ms hot, as on the GPU hosts (0.6-0.8 ms a step there). Its
code and data are cold after each forward, so what counts here is how much distinct
code a call runs, not how much work it does in a loop. Run before and after a change
to the split or the seal; the GPU launch (bench_tpot.py) then gives the figure that
counts.

    TRITON_INTERPRET=1 PYTHONPATH=overlay:. .venv/bin/python -m benchmarks.cpu.burst_timeline
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="idle,hs,idle,hs")
    ap.add_argument("--reps", type=int, default=3, help="bursts per mode (after one warm-up)")
    ap.add_argument("--input-len", type=int, default=64)
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import numpy as np
    from vllm import LLM, SamplingParams

    from benchmarks.gpu.workloads import hook_config, mode_hooks, model_dir
    from graphtap.runner_info import WORKER_EXTENSION

    path, cfg = model_dir("tiny")
    # 8 prompts a prefill step, as bench_tpot's 2048-token steps of 256-token prompts
    llm = LLM(model=path, seed=0, max_model_len=400, max_num_seqs=64, dtype="float32",
              hook_manager="graphtap", hook_config=hook_config(cfg, ["mixed", "dump"]),
              enable_prefix_caching=False, enforce_eager=True,
              worker_extension_cls=WORKER_EXTENSION,  # graphtap_host_timeline
              max_num_batched_tokens=8 * args.input_len)
    rng = np.random.default_rng(1)
    vec = (rng.normal(size=cfg["hidden_size"]) * 0.1).astype(np.float32).tolist()

    def burst(mode: str) -> list:
        hooks = mode_hooks(mode, cfg, vec, args.input_len, "hs")
        params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0,
                                **({"hooks": hooks} if hooks else {}))
        prompts = [{"prompt_token_ids": rng.integers(10, cfg["vocab_size"] - 10,
                                                     args.input_len).tolist()}
                   for _ in range(64)]
        llm.collective_rpc("graphtap_host_timeline")  # the calls before: dropped
        llm.generate(prompts, [params] * 64, use_tqdm=False)
        return llm.collective_rpc("graphtap_host_timeline")[0]

    for mode in args.modes.split(","):
        burst(mode)  # warm-up
        calls: dict[str, list[float]] = {}
        t0 = time.perf_counter()
        for _ in range(args.reps):
            for name, _, ms in burst(mode):
                calls.setdefault(name, []).append(ms)
        wall = (time.perf_counter() - t0) / args.reps
        print(f"{mode}: burst {wall * 1e3:.0f} ms")
        for name, ms in sorted(calls.items()):
            print(f"  {name:22s} {sum(ms) / args.reps:7.3f} ms a burst, "
                  f"{len(ms) / args.reps:5.1f} calls, median {statistics.median(ms):.3f} ms")


if __name__ == "__main__":
    main()
