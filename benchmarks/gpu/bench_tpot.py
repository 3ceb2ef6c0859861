#!/usr/bin/env python3
"""End-to-end TPOT of stock vLLM vs graphtap (idle and steering), Poisson arrivals.

One engine launch per (model, variant): `--variant stock` runs vLLM without a hook manager
(on the GPU host: the stock wheel), `--variant graphtap` runs the patched wheel with
hook_manager="graphtap" and one configured site (blocks.{L/2}.hook_resid_post); its modes
alternate inside that launch, so they share compile artifacts, graphs and memory layout and
differ only in table contents: idle (no hooks), steer (every request adds a vector at that
site, all positions), hs (hidden states at 3 layers, last prompt token), qk (post-RoPE q at
the last prompt token and k at every prompt token, 4 layers x 4 heads), mixed (all of
them), dump (residuals at the hs layers at every position: the capture-throughput load,
rows and bytes counted per run), sink (dump's rows sent to the engine's bulk sink,
hook_config.sink_dir: rows and bytes on disk per run, and the machine's device-to-host and
disk write speeds measured first), focus (attention mass on two spans at the last prompt
token, 4 layers x 4 heads, read by an Attention Tracker guard), probe (one probe on one
layer at every generated token, read by a probe guard). Configured: the modes' sites.

Per (rate, repetition): N requests of IN prompt tokens and OUT output tokens
(ignore_eos), arrivals Poisson at `rate` req/s, in-process AsyncLLM; a request's TPOT is
(t_last_token - t_first_token) / (OUT - 1); a run's figure is the median over requests;
the reported figure is the median of the repetitions. Inside a repetition every mode gets
the same arrival times and prompts, and the modes' order changes between repetitions
(workloads.mode_order: every mode follows every other equally often, since session 27;
before, rotations), so a mode's overhead vs idle is measured paired: per request,
its TPOT in that mode over its TPOT in idle (`summary_overhead_vs_idle_pct`: median of
those ratios per repetition, and pooled over repetitions). After the warm-up the process's
GC heap is frozen, as `vllm serve` does; each run records the collector's pauses.
Results: JSON per launch; `--report` merges them into tpot.md (overhead vs stock).

  GPU:  python -m benchmarks.gpu.bench_tpot --model llama3-8b --variant stock --out benchmarks/results
  CPU:  python -m benchmarks.gpu.bench_tpot --quick --variant graphtap   (tiny model, CI smoke; no speed claims)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.gpu.first_token import fetch_timeline, frontend_timeline, marks
from benchmarks.gpu.host_info import GcPauses, gpu_name, vllm_version
from benchmarks.gpu.tpot_stats import engine_tpot_ms, report, summarise, ttft_phases
from benchmarks.gpu.workloads import (ARCHS, count_rows, hook_config, link_probe, mode_hooks,
                                      mode_order, model_dir, sink_totals, steer_vector)

REQUESTS_PER_RATE = {1: 12, 4: 24, 8: 32, 16: 48}


def engine_args(args, path: str, cfg: dict, memory: float | None = None):
    from vllm.engine.arg_utils import AsyncEngineArgs

    kw = dict(model=path, load_format="dummy", skip_tokenizer_init=True, seed=0,
              max_model_len=args.input_len + args.output_len + 16, max_num_seqs=64,
              enable_prefix_caching=False)
    if args.quick:
        kw.update(dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True,
                  load_format="auto", skip_tokenizer_init=False)
    else:
        kw.update(dtype="bfloat16", gpu_memory_utilization=0.85,
                  compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"})
        if args.prefill_graphs:  # graphs up to the step budget (graphtap harvest's option)
            from graphtap.graph_sizes import prefill_compilation_config

            kw.update(max_num_batched_tokens=args.prefill_graphs,
                      compilation_config=prefill_compilation_config(args.prefill_graphs))
    if args.trace_modes:  # vLLM's torch profiler, started around the traced bursts only
        kw.update(profiler_config={"profiler": "torch", "torch_profiler_dir": str(
            trace_dir(args)), "torch_profiler_with_stack": False})
    if memory is not None:  # engines sharing the device (bench_twin.py)
        kw.update(gpu_memory_utilization=memory)
    if args.variant == "graphtap":
        from graphtap.runner_info import WORKER_EXTENSION

        config = hook_config(cfg, args.modes.split(",") + args.burst_modes.split(","),
                             args.sink_layers)
        if args.sink_queue_gb and "sink_dir" in config:  # host memory the sink may fill
            config["sink_max_queued_bytes"] = int(args.sink_queue_gb * 2**30)
        if args.hold_outputs_mb:  # captures go home at a step that may finish them
            config["hold_outputs_bytes"] = int(args.hold_outputs_mb * 2**20)
        if args.split_in_engine:  # deferred steps split on the output thread (A/B)
            config["split_in_frontend"] = False
        args.sink_dir = config.get("sink_dir")
        kw.update(hook_manager="graphtap", hook_config=config,
                  worker_extension_cls=WORKER_EXTENSION)
    return AsyncEngineArgs(**kw)


async def hook_counters(engine) -> dict:
    """The workers' cumulative graphtap counters (stats keys *_total: ring steps and
    reads, the host time reads took), so a run's figures say what its steps did."""
    try:
        workers = await engine.collective_rpc("graphtap_hook_stats")
    except Exception as e:  # a stock engine, or an older overlay
        return {"error": repr(e)}
    return {f"{family}.{k}": v for family, counts in (workers[0] or {}).items()
            for k, v in counts.items() if k.endswith("_total")}


async def one_request(engine, rid: str, ids: list[int], params, start_at: float, t0: float):
    from vllm.inputs import TokensPrompt

    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    times, last, start, first = [], None, time.monotonic(), 0.0  # the engine core's clock
    async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), params, rid):
        n = len(out.outputs[0].token_ids)
        now = time.perf_counter()
        if not times:
            first = time.monotonic()
        times.extend([now] * (n - len(times)))
        last = out
    return (times, count_rows(getattr(last, "hooks", None)), engine_tpot_ms(last),
            ttft_phases(last, start, first) if times else None, marks(last))


async def run_rate(engine, args, cfg, rate: float, rep: int, hooks, burst: int = 0,
                   t0: float | None = None) -> dict:
    """Poisson arrivals at `rate`, or with `burst` > 0 that many requests at once (a
    fixed-concurrency decode measurement: far less noisy, so small overheads show).
    Arrivals count from `t0` (perf_counter; default now): bench_twin.py gives two engines'
    runs one t0 so their requests arrive at the same moments."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    n = (burst or args.requests_by_rate.get(rate) or args.requests  # set by prepare()
         or REQUESTS_PER_RATE.get(int(rate), 24))
    rng = np.random.default_rng([rep + 1, int(rate), burst])
    gaps = rng.exponential(1.0 / rate, size=n)
    starts = np.zeros(n) if burst else np.cumsum(gaps) - gaps[0]
    vocab = cfg["vocab_size"]
    extra = {"hooks": hooks} if hooks else {}  # stock vLLM has no such field
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0,
                            output_kind=RequestOutputKind.CUMULATIVE, **extra)
    pauses = GcPauses()
    t0 = time.perf_counter() if t0 is None else t0
    since = time.monotonic()  # the engine core's clock (first_token.py)
    tasks = [one_request(engine, f"r{rate}-{rep}-{i}-{time.monotonic_ns()}",
                         rng.integers(10, vocab - 10, args.input_len).tolist(), params,
                         float(starts[i]), t0) for i in range(n)]
    with pauses:
        results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    all_times, counts, by_request_engine, phases, ttft_marks = (list(x) for x in zip(*results))
    rows, nbytes, failed = (sum(c[i] for c in counts) for i in range(3))
    per_request = [c[0] for c in counts]
    by_request = [(t[-1] - t[0]) / (len(t) - 1) * 1000 if len(t) > 1 else None
                  for t in all_times]  # request i: same arrival and prompt in every mode
    tpots = [t for t in by_request if t is not None]
    ttft_by_request = [(t[0] - t0 - s) * 1000 if t else None for t, s in zip(all_times, starts)]
    ttfts = [t for t in ttft_by_request if t is not None]
    return {"rate": f"burst{burst}" if burst else rate, "rep": rep, "requests": n,
            "tpot_ms_median": statistics.median(tpots),
            "tpot_ms_p90": float(np.percentile(tpots, 90)), "ttft_ms_median": statistics.median(ttfts),
            "wall_s": wall, "rows": rows, "capture_bytes": nbytes, "capture_failed": failed,
            "rows_per_s": rows / wall,
            # a capturing request with no rows and no error would be a silent loss
            "rows_per_request_min": min(per_request), "rows_per_request_max": max(per_request),
            "tpot_ms_by_request": by_request,
            # request i is admitted i-th in every mode's burst: TTFTs compare by position
            "ttft_ms_by_request": ttft_by_request,
            "ttft_phases_ms_by_request": phases,  # tpot_stats.ttft_phases
            "ttft_marks_by_request": ttft_marks, "start_monotonic": since,
            "tpot_engine_ms_by_request": by_request_engine,
            "tpot_engine_ms_median": statistics.median(e) if (e := [
                t for t in by_request_engine if t is not None]) else None,
            # the frontend's (this process's) garbage-collector pauses during the run
            "frontend_gc_ms": round(pauses.ms, 2), "frontend_gc_full": pauses.full}


async def bench(args) -> dict:
    from vllm.v1.engine.async_llm import AsyncLLM

    path, cfg = model_dir(args.model)
    t_start = time.perf_counter()
    engine = AsyncLLM.from_engine_args(engine_args(args, path, cfg))
    startup = time.perf_counter() - t_start
    modes = ["plain"] if args.variant == "stock" else args.modes.split(",")
    burst_modes = [] if args.variant == "stock" else [m for m in args.burst_modes.split(",") if m]
    vec = steer_vector(cfg)
    result = {"model": args.model, "variant": args.variant, "input_len": args.input_len,
              "output_len": args.output_len, "startup_s": startup, "runs": [],
              "host": platform.node(), "gpu": gpu_name(), "vllm": vllm_version(),
              "split_in_frontend": not args.split_in_engine,
              "switch_interval_ms": sys.getswitchinterval() * 1e3}
    out = Path(args.out) / f"tpot-{args.model}-{args.variant}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if "sink" in modes:  # the limits the sink is measured against, on this machine
        result["link"] = link_probe()
    try:
        await run_rate(engine, args, cfg, max(args.rates or [8.0]), -1, None)  # warm-up only
        # and a burst of each size (session 21: the first 64 at once ran ~50 ms slow)
        for burst in [] if args.quick else args.bursts:
            await run_rate(engine, args, cfg, 1.0, -1, None, burst)
        # As `vllm serve` does after start (server_utils): the frontend's static objects
        # leave the collector's reach, so its pauses do not scan them (the engine core
        # freezes its own heap). Pauses that remain are counted per run.
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()
        for rep in range(args.reps):
            for rate, burst in loads(args):
                # modes alternate (same engine, same moment), in a balanced order per rep
                for mode in mode_order(modes + (burst_modes if burst else []), rep):
                    before = sink_totals(getattr(args, "sink_dir", None))
                    r = await run_rate(engine, args, cfg, rate, rep,
                                       mode_hooks(mode, cfg, vec, args.input_len,
                                                  args.sink_layers), burst)
                    r["mode"] = mode
                    if mode == "sink":
                        r.update(await sink_run(engine, before, r["wall_s"], args.quick))
                    if args.variant == "graphtap":
                        r["hook_counters"] = await hook_counters(engine)
                        # a burst's phase calls until its last first token (first_token.py)
                        firsts = [m[1] for m in r["ttft_marks_by_request"] if m]
                        calls = await fetch_timeline(engine, r["start_monotonic"],
                                                     max(firsts, default=0.0))
                        if burst and calls is not None:
                            r["host_timeline"] = calls
                        if burst and (calls := frontend_timeline(
                                engine, r["start_monotonic"])) is not None:
                            r["frontend_timeline"] = calls
                    result["runs"].append(r)
                    print(json.dumps({k: v for k, v in r.items() if not k.endswith("_timeline")}),
                          flush=True)
                write_result(result, out)
        for mode in [m for m in args.trace_modes.split(",") if m]:
            await traced_burst(engine, args, cfg, vec, mode)
    finally:
        engine.shutdown()
    return write_result(result, out, final=True)


def trace_dir(args) -> Path:
    return Path(args.out).resolve() / "traces"


async def traced_burst(engine, args, cfg, vec, mode: str) -> None:
    """One more burst of `mode` (the largest of --bursts) under vLLM's torch profiler: a
    timeline of the frontend, the engine core and the worker, host and device, in
    <out>/traces (issue 18: where a hooked burst's first step spends what graphtap's
    host clock does not account for). Its figures are not counted with the runs."""
    await engine.start_profile(profile_prefix=f"burst-{mode}")
    try:
        await run_rate(engine, args, cfg, 1.0, -1, mode_hooks(
            mode, cfg, vec, args.input_len, args.sink_layers), max(args.bursts or [1]))
    finally:
        await engine.stop_profile()
    # vLLM names its trace files by process and time: each burst's go in a folder of its own
    root = trace_dir(args)
    (root / f"burst-{mode}").mkdir(exist_ok=True)
    for f in root.glob("*.gz"):
        f.rename(root / f"burst-{mode}" / f.name)


async def sink_run(engine, before: tuple[int, int], wall: float, keep: bool = False) -> dict:
    """A sink run's rows and bytes on disk, once the worker says all are written
    (graphtap_sink_sync), and the rates over the run's wall (settle_s: the wait for the
    writer after the run's last token; sync_s: then the wait for the kernel to put the
    page cache's dirty pages on the disk, os.sync, so the _disk rate is the disk's)."""
    t = time.perf_counter()
    index = (await engine.collective_rpc("graphtap_sink_sync"))[0]
    settle = time.perf_counter() - t
    t = time.perf_counter()
    await asyncio.to_thread(os.sync)  # this host's disk holds the shards
    synced = time.perf_counter() - t
    root = Path(index["root"])
    rows = sum(s["rows"] for s in index["shards"]) - before[0]
    nbytes = sum(s["bytes"] for s in index["shards"]) - before[1]
    if not keep:  # counted: the files go (a harvest of every layer fills a 64 GiB disk)
        for shard in index["shards"]:
            (root / shard["file"]).unlink(missing_ok=True)
    return {"sink_rows": rows, "sink_bytes": nbytes, "sink_rows_per_s": rows / wall,
            "sink_gb_per_s": nbytes / wall / 1e9, "sink_settle_s": settle,
            "sink_rows_per_s_settled": rows / (wall + settle), "sink_sync_s": synced,
            "sink_gb_per_s_disk": nbytes / (wall + settle + synced) / 1e9}


def loads(args) -> list[tuple[float, int]]:
    """(rate, burst) of one repetition: the Poisson rates, then the bursts (burst > 0)."""
    return [(rate, 0) for rate in args.rates] + [(1.0, b) for b in args.bursts]


def write_result(result: dict, out: Path, final: bool = False) -> dict:
    """Partial results (they survive a kill: written once per load, not per run, as the
    file grows to megabytes over hundreds of short runs), or the final summarised ones."""
    if final:
        summarise(result)
    out.write_text(json.dumps(result, indent=1))
    if final:
        print(f"wrote {out}")
    return result


def parser(doc: str = __doc__) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=[*ARCHS, "tiny"], default="llama3-8b")
    ap.add_argument("--variant", choices=["stock", "graphtap"], default="graphtap")
    ap.add_argument("--modes", default="idle,steer",
                    help="graphtap modes, alternated: idle, idle2, steer, hs, qk, mixed, dump, "
                         "focus (Attention Tracker guard), probe (probe guard)")
    ap.add_argument("--burst-modes", default="",
                    help="modes run only at the bursts (e.g. dump: the throughput load)")
    ap.add_argument("--sink-layers", choices=["hs", "all", "streams"], default="hs",
                    help="the sink mode's sites (workloads.sink_sites)")
    ap.add_argument("--sink-queue-gb", type=float, default=0,
                    help="the sink's bound on queued rows (default: the engine's 256 MiB); "
                         "larger: the engine runs ahead of the disk into host memory")
    ap.add_argument("--hold-outputs-mb", type=float, default=0,
                    help="hook_config.hold_outputs_bytes in MiB: capturing requests' step "
                         "outputs held on the worker until a step that may finish them "
                         "(default: off, every step's travel with its tokens)")
    ap.add_argument("--split-in-engine", action="store_true",
                    help="hook_config.split_in_frontend off: a deferred capture step is "
                         "split on the engine core's output thread, as before s40")
    ap.add_argument("--switch-interval-ms", type=float, default=0,
                    help="this process's (the frontend's) GIL switch interval, an "
                         "experiment (default: Python's 5 ms)")
    ap.add_argument("--prefill-graphs", type=int, default=0, metavar="TOKENS",
                    help="steps of TOKENS tokens with CUDA graphs up to that size "
                         "(graph_sizes.py; default: vLLM's sizes, none above 128 tokens "
                         "at 64 sequences)")
    ap.add_argument("--rates", default="1,4,8,16")
    ap.add_argument("--trace-modes", default="",
                    help="after the runs, one burst per mode listed (e.g. idle,hs) under "
                         "vLLM's torch profiler, its traces in <out>/traces")
    ap.add_argument("--bursts", default="", help="also: N requests at once, e.g. 1,16,64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=0, help="per run (default: by rate)")
    ap.add_argument("--requests-by-rate", default="",
                    help="per run at some rates, e.g. 1:6,16:24 (a slow rate's runs are long)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    ap.add_argument("--quick", action="store_true", help="CPU smoke run on a tiny model")
    ap.add_argument("--report", action="store_true", help="only merge results into tpot.md")
    return ap


def prepare(args) -> None:
    """Loads parsed; --quick's tiny CPU configuration."""
    args.rates = [float(r) for r in args.rates.split(",") if r]
    args.bursts = [int(b) for b in args.bursts.split(",") if b]
    args.requests_by_rate = {float(r): int(n) for r, n in
                             (kv.split(":") for kv in args.requests_by_rate.split(",") if kv)}
    if args.quick:
        args.model, args.rates, args.reps = "tiny", [8.0], 1
        args.bursts = args.bursts or [3]
        args.requests, args.input_len, args.output_len = args.requests or 4, 16, 8
        # before vLLM is imported: it decides once whether Triton (so Model Runner V2,
        # so the hook slots) is there
        os.environ.setdefault("TRITON_INTERPRET", "1")


def main() -> int:
    args = parser().parse_args()
    if args.report:
        print(report(Path(args.out)))
        return 0
    prepare(args)
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    asyncio.run(bench(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
