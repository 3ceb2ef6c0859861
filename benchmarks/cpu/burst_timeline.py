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
    from benchmarks.gpu.profile_capture import burst as run_burst
    from benchmarks.gpu.profile_capture import engine
    from benchmarks.gpu.workloads import model_dir

    path, cfg = model_dir("tiny")
    # 8 prompts a prefill step, as bench_tpot's 2048-token steps of 256-token prompts
    llm = engine(path, cfg, cpu=True, batched_tokens=8 * args.input_len)

    def burst(mode: str) -> list:
        llm.collective_rpc("graphtap_host_timeline")  # the calls before: dropped
        run_burst(llm, cfg, mode, 64, args.input_len, 8)
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
