#!/usr/bin/env python3
"""Capture overhead measured on two engines at once: one runs a mode, the other idle, at
the same moment, with the same arrivals and prompts.

Why: on the lent H200's host, a small model's steps (Qwen2-1.5B: 2-4 ms) are host-bound
and the host's speed moves by 10-30 % within seconds (the sixth session: graph launches
alone 0.4-0.7 ms between runs of the same work). bench_tpot.py pairs a mode's run with
an idle run seconds apart, and that drift did not average out over 22 repetitions (its
A/A control moved 10 % pooled). Here the pair runs side by side: two engines of the same
configuration (each `--memory` of the device; separate engine-core processes, one client
process), so what slows the host slows both. Which engine runs the mode alternates per
repetition (their differences cancel), and mode `idle2` is the A/A control: both engines
idle. Both runs count arrivals from one t0, and which engine is submitted first flips
every two repetitions, apart from which runs the mode. Each run is paired with the idle
run beside it (`pair`), per request, as bench_tpot.py pairs
(tpot_stats.paired_overheads), on the client's and on the engine core's clock. Both
engines share one device, so absolute TPOT is not a solo figure; the overhead is a ratio
under the same conditions.

  GPU: python -m benchmarks.gpu.bench_twin --model qwen2-1.5b --modes idle2,hs,qk --rates 4,16 --bursts 16,64
  CPU: python -m benchmarks.gpu.bench_twin --quick   (tiny model, CI smoke; no speed claims)
  Table: python -m benchmarks.gpu.capture_report [--engine] $OUT/twin-qwen2-1.5b.json
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from benchmarks.gpu.bench_tpot import engine_args, loads, parser, prepare, run_rate, write_result
from benchmarks.gpu.host_info import gpu_name, vllm_version
from benchmarks.gpu.workloads import mode_hooks, mode_order, model_dir, steer_vector


async def bench(args) -> dict:
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.v1.engine.async_llm import AsyncLLM

    path, cfg = model_dir(args.model)
    memory = 0.15 if args.quick else args.memory  # CPU: two KV caches in 24 GiB
    t_start = time.perf_counter()
    engines = [AsyncLLM.from_engine_args(engine_args(args, path, cfg, memory))
               for _ in range(2)]
    result = {"model": args.model, "variant": "graphtap-twin", "input_len": args.input_len,
              "output_len": args.output_len, "startup_s": time.perf_counter() - t_start,
              "runs": [], "gpu": gpu_name(), "vllm": vllm_version(), "memory": memory}
    vec = steer_vector(cfg)
    modes = [m for m in args.modes.split(",") if m and m != "idle"]
    burst_modes = [m for m in args.burst_modes.split(",") if m and m != "idle"]  # e.g. dump
    out = Path(args.out) / f"twin-{args.model}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        warm = max(args.rates or [8.0])
        await asyncio.gather(*(run_rate(e, args, cfg, warm, -1, None) for e in engines))
        freeze_gc_heap()  # as bench_tpot.py (and `vllm serve`) after the warm-up
        for rep in range(args.reps):
            for rate, burst in loads(args):
                for mode in mode_order(modes + (burst_modes if burst else []), rep):
                    a, b = engines if rep % 2 == 0 else engines[::-1]  # who runs the mode
                    # one t0: both runs' requests arrive at the same moments; whose request
                    # is submitted first at a moment flips every two repetitions, apart
                    # from who runs the mode (session 7: the first-submitted engine's TPOT
                    # was 3 % higher at 16 req/s, in the A/A control too)
                    t0 = time.perf_counter() + 0.05  # past both runs' prompt generation
                    first = (rep // 2) % 2 == 0
                    pair = [run_rate(a, args, cfg, rate, rep, mode_hooks(mode, cfg, vec),
                                     burst, t0),
                            run_rate(b, args, cfg, rate, rep, None, burst, t0)]
                    done = await asyncio.gather(*(pair if first else pair[::-1]))
                    ra, rb = done if first else done[::-1]
                    ra.update(mode=mode, pair=mode, engine=rep % 2, first=first)
                    rb.update(mode="idle", pair=mode, engine=1 - rep % 2, first=not first)
                    result["runs"] += [ra, rb]
                    print(json.dumps(ra), flush=True)
                    print(json.dumps(rb), flush=True)
                write_result(result, out)
    finally:
        for e in engines:
            e.shutdown()
    return write_result(result, out, final=True)


def main() -> int:
    ap = parser(__doc__)
    ap.set_defaults(modes="idle2,hs,qk", model="qwen2-1.5b")
    ap.add_argument("--memory", type=float, default=0.4,
                    help="gpu_memory_utilization of each engine (two share the device)")
    args = ap.parse_args()
    args.variant = "graphtap"
    prepare(args)
    asyncio.run(bench(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
