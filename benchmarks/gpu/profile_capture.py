#!/usr/bin/env python3
"""Where does a capturing step's time go, and how many rows per second can the courier
return? One in-process engine (worker included, so torch.profiler sees the runner's host
side and the hook manager; configured like bench_tpot.py's graphtap launch, so the
compile cache is shared), one burst of requests per bench mode (idle, hs, qk, mixed,
dump, probe, focus: the same specs as bench_tpot.py). Per mode: wall time, rows and
bytes returned and rows/s (unprofiled run), then a profiled run: graphtap's named host
ranges per step (prepare_step, collect, to_cpu, per_request), its kernels' device time
per step, the work it adds per step over idle (added_work), the host calls that stall a
step (stream/device synchronisations, pinned allocations, blocking copies) and the top
host ops. Writes $OUT/profile-capture.json; `--cpu` runs the same logic on the tiny
model.

    PYTHONPATH=/tmp/vllm-site/patched:/tmp/vllm-site/deps:$GT_SITE \\
        python -m benchmarks.gpu.profile_capture --model qwen2-1.5b
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


import numpy as np

from benchmarks.gpu.host_info import GcPauses
from benchmarks.gpu.workloads import ARCHS, count_rows, hook_config, mode_hooks, model_dir

STALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
          "cudaHostAlloc", "cudaFreeHost", "cudaMemcpy", "aten::item", "aten::_local_scalar_dense",
          "aten::nonzero", "cudaMallocHost", "cudaMalloc", "cudaFree")


def engine(path: str, cfg: dict, cpu: bool, sink: str | None = None, sink_gb: float = 4.0,
           focus: bool = False, max_len: int = 400, prefill_graphs: bool = False,
           batched_tokens: int | None = None):
    """`sink`: the sink mode's layers (workloads.sink_sites), None: no sink mode;
    `sink_gb`: its memory bound; `focus`: configure the focus guard's pattern sites;
    `prefill_graphs`: CUDA graphs up to the 2048-token step (graph_sizes.py);
    `batched_tokens`: a step's most tokens (default: vLLM's on the CPU, 2048 on a GPU)."""
    from vllm import LLM

    from graphtap.runner_info import WORKER_EXTENSION

    # Every capture mode's sites, whichever modes run: the same configuration as a
    # bench_tpot.py launch of all modes, so the two share compiled artifacts.
    # log stats on: each output then carries its time to first token (RequestStateStats).
    config = hook_config(cfg, ["mixed", "dump"] + (["sink"] if sink else []) +
                         (["focus"] if focus else []), sink or "hs")
    if sink:
        config["sink_max_queued_bytes"] = int(sink_gb * 2**30)
    kw = dict(model=path, seed=0, max_model_len=max_len, max_num_seqs=64, hook_manager="graphtap",
              hook_config=config, enable_prefix_caching=False,
              worker_extension_cls=WORKER_EXTENSION,  # graphtap_sink_sync
              disable_log_stats=False)
    if cpu:
        kw.update(dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True)
    else:
        # 2048-token steps as AsyncLLM schedules them in bench_tpot.py (LLM's own default
        # is larger: one 16k-token prefill step, where qk's 4 k rows per token overflowed
        # capture_rows and its profile showed nothing).
        kw.update(dtype="bfloat16", gpu_memory_utilization=0.85, load_format="dummy",
                  skip_tokenizer_init=True, max_num_batched_tokens=2048,
                  compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"})
        if prefill_graphs:
            from graphtap.graph_sizes import prefill_compilation_config

            kw["compilation_config"] = prefill_compilation_config(2048)
    if batched_tokens:
        kw["max_num_batched_tokens"] = batched_tokens
    return LLM(**kw)


def sink_written(llm, seen: set[str]) -> tuple[int, int]:
    """(rows, bytes) the worker's sink wrote since the shards in `seen` (which it joins),
    once it says everything put is written (graphtap_sink_sync); the files counted go
    (a harvest of every layer fills the 64 GiB disk)."""
    index = llm.collective_rpc("graphtap_sink_sync")[0]
    new = [s for s in index["shards"] if s["file"] not in seen]
    for shard in new:
        (Path(index["root"]) / shard["file"]).unlink(missing_ok=True)
        seen.add(shard["file"])
    return sum(s["rows"] for s in new), sum(s["bytes"] for s in new)


def burst(llm, cfg, mode: str, n: int, in_len: int, out_len: int, sink: str = "hs",
          seen: set[str] | None = None) -> dict:
    """`seen`: the sink shards counted by earlier bursts (sink mode)."""
    from vllm import SamplingParams

    rng = np.random.default_rng(1)
    vec = (rng.normal(size=cfg["hidden_size"]) * 0.1).astype(np.float32).tolist()
    hooks = mode_hooks(mode, cfg, vec, in_len, sink)
    params = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0,
                            **({"hooks": hooks} if hooks else {}))
    prompts = [{"prompt_token_ids": rng.integers(10, cfg["vocab_size"] - 10, in_len).tolist()}
               for _ in range(n)]
    pauses = GcPauses()  # engine, worker and frontend all run in this process
    t0 = time.perf_counter()
    with pauses:
        outs = llm.generate(prompts, [params] * n, use_tqdm=False)
    wall = time.perf_counter() - t0
    errors = [o.hooks.error for o in outs if o.hooks is not None and o.hooks.error]
    rows, nbytes, _ = (sum(c) for c in zip(*(count_rows(o.hooks) for o in outs)))
    sink_out = {}
    if mode == "sink":  # the rows went to the worker's sink: counted there once written
        t = time.perf_counter()
        rows, nbytes = sink_written(llm, seen)
        settle = time.perf_counter() - t
        sink_out = {"sink_settle_s": round(settle, 3),
                    "sink_stats": llm.collective_rpc("graphtap_hook_stats")[0].get("sink"),
                    "sink_GB_per_s_settled": round(nbytes / (wall + settle) / 1e9, 3)}
    ttft = [o.metrics.first_token_latency * 1000 for o in outs
            if getattr(o.metrics, "first_token_latency", None)]
    return {"mode": mode, "wall_s": wall, "errors": errors[:1], "rows": rows,
            "bytes": nbytes, "rows_per_s": rows / wall, "MB_per_s": nbytes / wall / 2**20,
            # in-process: no IPC between engine core and frontend in this figure
            "ttft_ms_median": float(np.median(ttft)) if ttft else None,
            "gc_ms": round(pauses.ms, 2), "gc_full": pauses.full, **sink_out}


# graphtap's Triton kernels (ops/*_triton.py); CUPTI reports them by function name, also
# when replayed from a CUDA graph
GRAPHTAP_KERNELS = ("_capture_kernel", "_steer_kernel", "_pattern_kernel", "_tokens_kernel",
                    "_flags_kernel", "_rows_kernel", "_fit_kernel", "_refit_kernel",
                    "_probe_kernel", "_mass_kernel", "_staged_rows_kernel",
                    "_staged_elements_kernel")


def device_ms(prof) -> tuple[float, float]:
    """(every device activity, graphtap's kernels) of a profiled run, in ms."""
    from torch.autograd import DeviceType

    total = ours = 0.0
    for e in prof.events():
        if e.device_type == DeviceType.CPU:
            continue
        t = e.time_range.elapsed_us() / 1000
        total += t
        ours += t if e.name.startswith(GRAPHTAP_KERNELS) else 0.0
    return total, ours


def device_gaps(prof) -> dict:
    """Where the device waited in a profiled run: its activities' intervals merged, the
    time from the first to the last (`span_ms`), busy and idle inside it, and the idle
    gaps over 0.1 ms (count, ms in all, the five largest with their offset from the
    start). A capture mode whose steps wait for the host shows more idle time than idle
    mode's; one whose kernels cost more shows more busy time (issue 18: a burst's
    capturing requests reached their first token 2-5 ms after idle ones)."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type != DeviceType.CPU and e.time_range.end > e.time_range.start)
    if not spans:
        return {}
    busy, gaps, (lo, hi) = 0.0, [], spans[0]
    first = lo
    for a, b in spans[1:]:
        if a > hi:
            busy += hi - lo
            gaps.append((a - hi, hi - first))
            lo, hi = a, b
        else:
            hi = max(hi, b)
    busy += hi - lo
    big = [g for g in gaps if g[0] > 100]
    return {"span_ms": round((hi - first) / 1000, 3), "busy_ms": round(busy / 1000, 3),
            "idle_ms": round(sum(g for g, _ in gaps) / 1000, 3),
            "gaps_over_100us": len(big),
            "gaps_over_100us_ms": round(sum(g for g, _ in big) / 1000, 3),
            "largest_gaps_ms_at_ms": [(round(g / 1000, 3), round(at / 1000, 1))
                                      for g, at in sorted(big, reverse=True)[:5]]}


def added_work(modes: list[dict]) -> None:
    """Per mode: graphtap's own work per step (its named host ranges plus its kernels'
    device time) over the idle runs' mean, in ms and in % of idle's step. Both halves are
    measured inside one run each, so unlike end-to-end TPOT they barely move with the
    host's speed from run to run; it is what graphtap adds where a step is host-bound
    (host part) or device-bound (device part), not a measured TPOT."""
    own = [sum(m["graphtap_host_ms_per_step"].values()) + m["graphtap_device_ms_per_step"]
           for m in modes]
    idle = [i for i, m in enumerate(modes) if m["mode"] == "idle"]
    if not idle:
        return
    base = sum(own[i] for i in idle) / len(idle)
    step = sum(modes[i]["step_ms"] for i in idle) / len(idle)
    for m, o in zip(modes, own):
        m["graphtap_added_ms_per_step"] = round(o - base, 4)
        m["graphtap_added_pct_of_idle_step"] = round((o - base) / step * 100, 2)


def step_kinds(prof) -> dict:
    """Host time between consecutive steps' `graphtap.prepare_step` by what the step did:
    `copy` (its rows were snapshotted and copied home: graphtap.to_cpu), `split` (a
    previous step's rows were split per request: graphtap.per_request), or neither, as
    count and median ms, plus the time `copy`/`split` steps took over the median plain
    step in all. Whether a capture load's extra time sits in the few capturing steps or
    spreads over all of them (session 7's qk burst: 1.4 ms per step more than idle on
    average, unattributed)."""
    names = ("graphtap.prepare_step", "graphtap.to_cpu", "graphtap.per_request")
    found: dict[str, list[float]] = {n: [] for n in names}
    for e in prof.events():  # one pass: a 64-request profile holds ~10^6 events
        if e.name in found:
            found[e.name].append(e.time_range.start)
    steps, copies, splits = (np.sort(np.array(found[n])) for n in names)
    if len(steps) < 2:
        return {}
    ms = np.diff(steps) / 1000
    kind = np.zeros(len(ms), dtype=int)
    for bit, marks in ((1, copies), (2, splits)):
        at = np.searchsorted(steps, marks, side="right") - 1
        np.bitwise_or.at(kind, at[(at >= 0) & (at < len(ms))], bit)
    plain = ms[kind == 0]
    base = float(np.median(plain)) if len(plain) else 0.0
    out = {"plain": {"count": int(len(plain)), "median_ms": round(base, 3)}}
    for bit, label in ((1, "copy"), (2, "split")):
        sel = ms[(kind & bit) != 0]
        out[label] = {"count": int(len(sel)),
                      "median_ms": round(float(np.median(sel)), 3) if len(sel) else None,
                      "over_plain_ms": round(float(np.sum(sel - base)), 2)}
    return out


def python_top(run, n: int = 60) -> dict[str, list[tuple[str, int, float, float]]]:
    """(function, calls, own ms, cumulative ms) of the n functions with the most own time
    in one run under cProfile. torch.profiler names torch ops and graphtap's ranges; a
    step's Python outside them (the scheduler, the output path, vLLM's own bookkeeping
    per request) shows only here (session 7: a qk burst's steps were 1.4 ms longer than
    idle's, of which graphtap's named ranges held 0.2)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(run)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, calls, tt, ct, callers)
    row = lambda f, line, name, calls, tt, ct: (  # noqa: E731
        f"{Path(f).name}:{line}({name})", calls, round(tt * 1000, 2), round(ct * 1000, 2))
    own = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    # graphtap's own functions by cumulative time: its share of the run, by call path
    ours = sorted(((k, v) for k, v in stats.items() if "graphtap" in k[0]),
                  key=lambda kv: -kv[1][3])[:n]
    return {"own": [row(*k, v[1], v[2], v[3]) for k, v in own],
            "graphtap_cumulative": [row(*k, v[1], v[2], v[3]) for k, v in ours]}


def write_trace(prof, stem: Path) -> str:
    """The profiled run as a gzipped Chrome trace (chrome://tracing, Perfetto)."""
    import gzip
    import shutil

    raw = stem.parent / f"{stem.name}.json"  # not with_suffix: "qwen2-1.5b" has a dot
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return f"{raw.name}.gz"


def main() -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=[*ARCHS, "tiny"], default="qwen2-1.5b")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--modes", default="idle,hs,qk,mixed,dump,idle")  # e.g. idle,qk,dump,idle
    ap.add_argument("--trace", nargs="?", const="all", default="",
                    help="also write each mode's profiled run (or only those of the modes "
                         "listed, e.g. qk) as a gzipped Chrome trace: the timeline of where a "
                         "capturing step's time goes (the device tool brings back files of "
                         "up to 16 MiB: a 64-request trace of every mode may not fit)")
    ap.add_argument("--cprofile", action="store_true",
                    help="also one run per mode under cProfile: its top Python functions by "
                         "own time (host time outside torch ops: the engine's own Python)")
    ap.add_argument("--sink-layers", choices=["hs", "all", "streams"], default="all",
                    help="the sink mode's sites (workloads.sink_sites)")
    ap.add_argument("--sink-queue-gb", type=float, default=4.0,
                    help="the sink's memory bound (graphtap harvest's default: 4 GiB)")
    ap.add_argument("--prefill-graphs", action="store_true",
                    help="GPU: CUDA graphs up to the 2048-token step (graph_sizes.py; "
                         "default: vLLM's, none above 128 tokens at 64 sequences)")
    ap.add_argument("--input-len", type=int, default=0, help="default: 256 (CPU: 16)")
    ap.add_argument("--output-len", type=int, default=0, help="default: 128 (CPU: 8)")
    args = ap.parse_args()
    # the worker in this process (set here, not at import: tests import write_trace)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.cpu:
        args.model = "tiny"
        # before vLLM is imported: it decides once whether Triton (so Model Runner V2,
        # so the hook slots) is there
        os.environ.setdefault("TRITON_INTERPRET", "1")
    path, cfg = model_dir(args.model)
    modes = args.modes.split(",")
    sink = args.sink_layers if "sink" in modes else None
    in_len, out_len = (16, 8) if args.cpu else (256, 128)
    in_len, out_len = args.input_len or in_len, args.output_len or out_len
    llm = engine(path, cfg, args.cpu, sink, args.sink_queue_gb, "focus" in modes,
                 max_len=max(400, in_len + out_len + 16), prefill_graphs=args.prefill_graphs)
    seen: set[str] = set()  # sink shards counted

    def run(mode: str) -> dict:
        return burst(llm, cfg, mode, args.requests, in_len, out_len, args.sink_layers, seen)

    run("idle")  # warm-up
    result = {"model": args.model, "requests": args.requests, "in": in_len, "out": out_len,
              "modes": []}
    activities = [ProfilerActivity.CPU] + ([] if args.cpu else [ProfilerActivity.CUDA])
    out = Path(os.environ.get("OUT", Path(__file__).resolve().parents[1] / "results"))
    out.mkdir(parents=True, exist_ok=True)
    for mode in modes:
        # a mode's first burst may grow host memory (the sink's first grew torch's pinned
        # pool: 6.9 s, a later one 2.9 s even under the profiler): kept apart, the figures
        # are the next burst's
        cold = run(mode)["wall_s"] if mode == "sink" else None
        r = run(mode)
        if cold is not None:
            r["cold_wall_s"] = cold
        with profile(activities=activities) as prof:
            r2 = run(mode)
        r["wall_profiled_s"] = r2["wall_s"]
        if args.trace == "all" or mode in args.trace.split(","):
            r["trace"] = write_trace(prof, out / f"trace-{args.model}-{mode}-{len(result['modes'])}")
        events = prof.key_averages()
        steps = next((e.count for e in events if e.key == "graphtap.prepare_step"), 0)
        r["steps"] = steps
        per_step: dict[str, float] = {}
        for e in events:  # a name may appear in several rows (CPU and device parts)
            if e.key.startswith("graphtap."):
                per_step[e.key] = per_step.get(e.key, 0.0) + e.cpu_time_total / 1000
        r["graphtap_host_ms_per_step"] = {k: round(v / max(steps, 1), 4)
                                          for k, v in per_step.items()}
        # the unprofiled run's step (the profiler slows the host, and graphtap's ranges
        # are measured under it: the added share errs high, not low)
        r["step_ms"] = round(r["wall_s"] * 1000 / max(steps, 1), 4)
        dev_total, dev_ours = device_ms(prof)
        r["device_ms_per_step"] = round(dev_total / max(steps, 1), 4)
        r["graphtap_device_ms_per_step"] = round(dev_ours / max(steps, 1), 4)
        r["step_kinds"] = step_kinds(prof)
        r["device_gaps"] = device_gaps(prof)
        r["stalls"] = {e.key: {"count": e.count, "cpu_ms": e.cpu_time_total / 1000}
                       for e in events if any(s in e.key for s in STALLS)}
        r["top_host_ops"] = [(e.key, e.count, round(e.self_cpu_time_total / 1000, 2))
                             for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]]
        if args.cprofile:
            r["python_top"] = python_top(lambda: run(mode))
        result["modes"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("top_host_ops", "python_top")}),
              flush=True)
    added_work(result["modes"])
    for r in result["modes"]:
        print(f"{r['mode']:6s} step {r['step_ms']:.3f} ms, graphtap adds "
              f"{r.get('graphtap_added_ms_per_step', 0):+.4f} ms "
              f"({r.get('graphtap_added_pct_of_idle_step', 0):+.2f} % of idle's step)")
    (out / "profile-capture.json").write_text(json.dumps(result, indent=1))
    del llm
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
