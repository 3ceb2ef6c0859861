"""A torch-profiler trace of one burst (bench_tpot --trace-modes) in a few lines, so the
device sends back figures rather than the trace (issue 18: where a hooked burst's first
steps spend time that graphtap's host clock does not account for). Per trace: the
device's kernels by total time, and the burst's first `--window` ms from its first
kernel: how long the device was busy, its idle gaps (the host not keeping up, or a
sync), and the host's CUDA runtime calls in that window by name.

    python -m benchmarks.gpu.trace_summary TRACE.json.gz [...] [--window 40] [--top 20]
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import Counter, defaultdict
from pathlib import Path

# kernel names that are graphtap's ops (Triton kernels, the steer-fused norm, gathers)
OURS = ("graphtap", "capture", "route", "steer", "_hook", "gather_rows", "scatter")


def events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def busy_and_gaps(kernels: list[tuple[float, float]], lo: float, hi: float,
                  min_gap_us: float) -> tuple[float, list[tuple[float, float]]]:
    """Union of kernel intervals inside [lo, hi) (us) and the gaps between them."""
    busy, gaps, end = 0.0, [], lo
    for ts, dur in sorted(kernels):
        if ts >= hi:
            break
        s, e = max(ts, lo), min(ts + dur, hi)
        if e <= end:
            continue
        if s > end and s - end >= min_gap_us:
            gaps.append((end - lo, s - end))
        busy += e - max(s, end)
        end = e
    return busy, gaps


def summarise(path: str, window_ms: float, top: int, min_gap_us: float,
              ops_in: str = "", gaps_from: float | None = None) -> list[dict] | None:
    """Prints the trace's summary; with gaps_from, returns its steps (gaps_by_step)."""
    ev = [e for e in events(path) if e.get("ph") == "X"]
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    print(f"== {path}: {len(kernels)} kernels")
    if not kernels:
        return None
    by_name = defaultdict(float)
    count = Counter()
    for k in kernels:
        by_name[k["name"][:90]] += k.get("dur", 0)
        count[k["name"][:90]] += 1
    total = sum(by_name.values())
    span = max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)
    print(f"   kernel time {total / 1e3:.2f} ms over {span / 1e3:.1f} ms")
    for name, us in sorted(by_name.items(), key=lambda x: -x[1])[:top]:
        print(f"   {us / 1e3:8.3f} ms {count[name]:6d}x  {name}")
    ours = {n: us for n, us in by_name.items() if any(s in n.lower() for s in OURS)}
    print(f"   graphtap-like kernels: {sum(ours.values()) / 1e3:.3f} ms "
          f"({sum(count[n] for n in ours)} launches)")
    for name, us in sorted(ours.items(), key=lambda x: -x[1])[:top]:
        print(f"     {us / 1e3:8.3f} ms {count[name]:6d}x  {name}")
    lo = min(k["ts"] for k in kernels)
    hi = lo + window_ms * 1e3
    busy, gaps = busy_and_gaps([(k["ts"], k.get("dur", 0)) for k in kernels], lo, hi,
                               min_gap_us)
    print(f"   first {window_ms:g} ms: device busy {busy / 1e3:.2f} ms; gaps >= "
          f"{min_gap_us:g} us (at ms, us): "
          + " ".join(f"{at / 1e3:.2f}:{d:.0f}" for at, d in gaps[:40]))
    runtime = defaultdict(lambda: [0, 0.0])
    for e in ev:
        if e.get("cat") == "cuda_runtime" and lo <= e["ts"] < hi:
            runtime[e["name"]][0] += 1
            runtime[e["name"]][1] += e.get("dur", 0)
    print("   runtime calls in the window: " + ", ".join(
        f"{n} {c}x {us / 1e3:.2f} ms" for n, (c, us) in
        sorted(runtime.items(), key=lambda x: -x[1][1])[:8]))
    notes = [e for e in ev
             if e.get("cat") == "user_annotation" and lo - 50e3 <= e["ts"] < hi]
    marks = Counter()
    for e in notes:
        marks[e["name"][:60]] += e.get("dur", 0)
    print("   annotations in the window (ms): " + ", ".join(
        f"{n} {us / 1e3:.2f}" for n, us in marks.most_common(12)))
    if ops_in:
        ops_inside(ev, [e for e in notes if e["name"].startswith(ops_in)], top)
    if gaps_from is None:
        return None
    gaps_by_host(ev, lo + gaps_from * 1e3, hi, top)
    return gaps_by_step(ev, lo + gaps_from * 1e3, hi, top)


def busy_loop_tid(ev: list[dict]):
    """The thread that runs the steps: graphtap's prepare_step ranges, else the one with
    the most CUDA runtime calls."""
    for e in ev:
        if e.get("name") == "graphtap.prepare_step":
            return e.get("tid")
    calls = Counter(e.get("tid") for e in ev if e.get("cat") == "cuda_runtime")
    return calls.most_common(1)[0][0] if calls else None


def gaps_by_step(ev: list[dict], lo: float, hi: float, top: int) -> list[dict]:
    """gaps_by_host per step: from the start of each of vLLM's step ranges on the busy
    loop (the worker's execute_context_* / execute_* annotations) to the next one's,
    graphtap's phases summed apart. Per step: its name, span and device idle time (ms),
    graphtap's share of it and the idle time by what the busy loop ran (us)."""
    view = busy_loop_view(ev)
    tid = view[0]
    # a step that began before lo (the burst's first, before its first kernel) from lo
    starts = sorted((max(e["ts"], lo), e["name"]) for e in ev if e.get("tid") == tid and
                    e.get("cat") == "user_annotation" and e["name"].startswith("execute_")
                    and e["ts"] < hi and e["ts"] + e.get("dur", 0) > lo)
    out = []
    for i, (ts, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else hi
        where = gaps_by_host(ev, ts, end, top, quiet=True, view=view)
        ours = sum(us for n, us in where.items() if n.startswith("graphtap."))
        print(f"   step {i + 1} {name[:44]}: {(end - ts) / 1e3:.2f} ms, device idle "
              f"{sum(where.values()) / 1e3:.3f}, graphtap {ours / 1e3:.3f}: " + ", ".join(
                  f"{n} {us / 1e3:.3f}" for n, us in
                  sorted(where.items(), key=lambda x: -x[1])[:top]))
        out.append({"step": name, "span_ms": round((end - ts) / 1e3, 3),
                    "device_idle_ms": round(sum(where.values()) / 1e3, 3),
                    "graphtap_ms": round(ours / 1e3, 3),
                    "idle_us_by_host": {n: round(us, 1) for n, us in where.items()}})
    return out


def busy_loop_view(ev: list[dict]) -> tuple:
    """(the busy loop's thread, the device's (start, duration) intervals): what every
    window of gaps_by_host reads, found once per trace."""
    return busy_loop_tid(ev), [(e["ts"], e.get("dur", 0)) for e in ev
                               if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def gaps_by_host(ev: list[dict], lo: float, hi: float, top: int,
                 quiet: bool = False, view: tuple | None = None) -> dict[str, float]:
    """The device's idle time in [lo, hi) laid over what the busy loop's thread was doing
    then: graphtap's innermost profiler range, else the outermost torch op, else the
    innermost other range (vLLM's step, torch.compile's region), else "(python)". A
    hooked burst's first steps are host-bound, so its added device idle time, by what
    the host ran meanwhile, is what its first tokens wait for."""
    tid, device = view if view is not None else busy_loop_view(ev)
    mine = sorted((e for e in ev if e.get("tid") == tid and e.get("cat") in
                   ("user_annotation", "cpu_op") and e["ts"] < hi
                   and e["ts"] + e.get("dur", 0) > lo), key=lambda e: e["ts"])
    ops, end = [], -1.0  # outermost torch ops: not inside an earlier one
    for e in mine:
        if e["cat"] == "cpu_op" and e["ts"] >= end:
            ops.append(e)
            end = e["ts"] + e.get("dur", 0)
    ranges = [e for e in mine if e["cat"] == "user_annotation"]
    # a zero-length stand-in at the end: idle time up to hi counts too
    _, gaps = busy_and_gaps(device + [(hi - 1e-3, 0.0)], lo, hi, 0.0)
    where: dict[str, float] = defaultdict(float)
    for at, dur in gaps:
        s, e = lo + at, lo + at + dur
        cover = [x for x in ranges + ops if x["ts"] < e and x["ts"] + x.get("dur", 0) > s]
        cuts = sorted({s, e} | {min(max(t, s), e) for x in cover
                                for t in (x["ts"], x["ts"] + x.get("dur", 0))})
        for a, b in zip(cuts, cuts[1:]):
            mid = (a + b) / 2
            inner = [x for x in cover if x["ts"] <= mid < x["ts"] + x.get("dur", 0)]
            ours = [x for x in inner if x["name"].startswith("graphtap.")]
            op = [x for x in inner if x["cat"] == "cpu_op"]
            pick = min(ours or op or inner, key=lambda x: x.get("dur", 0), default=None)
            where[pick["name"][:50] if pick else "(python)"] += b - a
    total = sum(where.values())
    if quiet:
        return dict(where)
    print(f"   device idle from {(lo - min(t for t, _ in device)) / 1e3:g} ms to the window's "
          f"end: {total / 1e3:.3f} ms, the busy loop meanwhile (ms): " + ", ".join(
              f"{n} {us / 1e3:.3f}" for n, us in sorted(where.items(), key=lambda x: -x[1])
              [:top]))
    return dict(where)


def ops_inside(ev: list[dict], ranges: list[dict], top: int) -> None:
    """Per range name (graphtap's profiler ranges: prepare_step, collect, to_cpu, ...),
    the torch ops and CUDA runtime calls that started inside its calls in the window,
    by total time (nested ops count within their parents too): which calls make a
    hooked step's host time."""
    calls = sorted((e for e in ev if e.get("cat") in ("cpu_op", "cuda_runtime")),
                   key=lambda e: e["ts"])
    starts = [e["ts"] for e in calls]
    for name in sorted({r["name"] for r in ranges}):
        mine = [r for r in ranges if r["name"] == name]
        inside: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for r in mine:
            lo, hi = r["ts"], r["ts"] + r.get("dur", 0)
            for e in calls[bisect.bisect_left(starts, lo):bisect.bisect_left(starts, hi)]:
                if e.get("tid") == r.get("tid"):
                    inside[e["name"][:60]][0] += 1
                    inside[e["name"][:60]][1] += e.get("dur", 0)
        total = sum(r.get("dur", 0) for r in mine)
        print(f"   inside {name}: {len(mine)} calls, {total / 1e3:.3f} ms; " + ", ".join(
            f"{n} {c}x {us / 1e3:.3f}" for n, (c, us) in
            sorted(inside.items(), key=lambda x: -x[1][1])[:top]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--window", type=float, default=40.0, help="ms from the first kernel")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--min-gap", type=float, default=100.0, help="us")
    ap.add_argument("--ops-in", default="",
                    help="ranges whose name starts so (graphtap.): the ops inside them")
    ap.add_argument("--gaps-from", type=float, default=None, metavar="MS",
                    help="the device's idle time from MS after the first kernel to the "
                         "window's end, by what the busy loop ran meanwhile")
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="with --gaps-from: each trace's steps (gaps_by_step) as JSON")
    args = ap.parse_args()
    steps = {}
    for path in args.traces:
        steps[path] = summarise(path, args.window, args.top, args.min_gap, args.ops_in,
                                args.gaps_from)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"window_ms": args.window, "from_ms": args.gaps_from, "traces": [
                {"trace": Path(p).name, "steps": s} for p, s in steps.items() if s]},
            indent=1))


if __name__ == "__main__":
    main()
