"""Figures of bench_tpot.py runs: median TPOT per mode and load, and each mode's overhead
vs idle paired per request (shared by bench_tpot.py and capture_report.py), the TTFT of
bursts by admission position, and a request's figures on the engine core's clock."""
from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import numpy as np

from benchmarks.gpu.first_token import first_token_window


def summarise(result: dict, ci: bool = False) -> None:
    """Median TPOT per mode and load, and the paired overheads vs idle on both clocks
    (with ci, each cell's bootstrap interval too: paired_overheads)."""
    summary: dict[str, dict[str, float]] = {}
    for r in result["runs"]:
        key = load_key(r)
        summary.setdefault(r["mode"], {}).setdefault(key, []).append(r["tpot_ms_median"])
    result["summary_tpot_ms"] = {m: {k: statistics.median(v) for k, v in d.items()}
                                 for m, d in summary.items()}
    result["summary_overhead_vs_idle_pct"] = paired_overheads(result["runs"], ci=ci)
    engine = paired_overheads(result["runs"], ENGINE, ci)
    if engine:  # launches from before the engine-clock figure have none
        result["summary_overhead_vs_idle_pct_engine"] = engine
    host = host_phases(result["runs"])
    if host:  # launches from before the hook manager's host clock have none
        result["summary_host_ms"] = host
    window = first_token_window(result["runs"])
    if window:  # bursts of launches with the hook manager's timeline (first_token.py)
        result["summary_first_token_ms"] = window


def host_phases(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per mode, the hook manager's host time per phase in one run (ms, and calls: the
    median over runs of what each run added to the workers' cumulative counters,
    hook_counters' host.<phase>_wall_ms_total / _calls_total). Runs in the order they
    ran; the first is left out (its counters hold the engine's start too)."""
    per_mode: dict[str, dict[str, list[float]]] = {}
    before: dict[str, float] | None = None
    for r in runs:
        now = {k[len("host."):]: v for k, v in (r.get("hook_counters") or {}).items()
               if k.startswith("host.") and k.endswith(("_wall_ms_total", "_calls_total"))}
        if before is not None and now:
            mode = per_mode.setdefault(r["mode"], {})
            for k, v in now.items():
                name = k.replace("_wall_ms_total", "_ms").replace("_calls_total", "_calls")
                mode.setdefault(name, []).append(v - before.get(k, 0))
        before = now or before
    return {m: {k: round(statistics.median(v), 3) for k, v in sorted(d.items())}
            for m, d in per_mode.items()}


def engine_tpot_ms(out) -> float | None:
    """TPOT on the engine core's clock: its outputs' timestamps of the first and the last
    token (RequestOutput.metrics, with stats logging on), so the frontend's own delays (this
    process's event loop, output handling) are left out: the control for the frontend
    figure when the two disagree."""
    m = getattr(out, "metrics", None) if out is not None else None
    n = len(out.outputs[0].token_ids) if out is not None else 0
    if m is None or n < 2 or not getattr(m, "first_token_ts", 0):
        return None
    return (m.last_token_ts - m.first_token_ts) / (n - 1) * 1000


PHASES = ("admit", "queue", "prefill", "deliver")


def ttft_phases(out, start: float, first: float) -> dict | None:
    """Where a request's TTFT went, from its RequestOutput.metrics (the engine core's
    events, stats logging on) and this process's times, all on CLOCK_MONOTONIC (one
    host): `admit` from the request's start to the engine core queueing it (the
    frontend's admission and the hand-over), `queue` until it was first scheduled,
    `prefill` until the engine core built the output of its first token (the steps'
    work and the worker's split of their rows), `deliver` until this process had the
    token (serialisation, the transport, the frontend's output handling)."""
    m = getattr(out, "metrics", None)
    if m is None or not getattr(m, "queued_ts", 0) or not getattr(m, "first_token_ts", 0):
        return None
    ms = {"admit": m.queued_ts - start, "queue": m.scheduled_ts - m.queued_ts,
          "prefill": m.first_token_ts - m.scheduled_ts, "deliver": first - m.first_token_ts}
    return {k: round(v * 1000, 3) for k, v in ms.items()}


def load_key(r: dict) -> str:
    return r["rate"] if isinstance(r["rate"], str) else f"{r['rate']:g}"


FRONTEND = "tpot_ms_by_request"  # per-request TPOT from token arrival in the client
ENGINE = "tpot_engine_ms_by_request"  # the same from the engine core's output timestamps


def paired_overheads(runs: list[dict], key: str = FRONTEND, ci: bool = False) -> dict:
    """Per mode and load: the overhead vs idle from per-request TPOT ratios (request i has
    the same arrival and prompt in both), per repetition (median of its ratios) and pooled
    (median of every repetition's ratios), in %. Far less noisy than comparing two runs'
    medians, whose requests met different batch mixes in different repetitions. With ci,
    each cell also gets `ci95`: the pooled figure's 95 % bootstrap interval."""
    # bench_twin.py: each run has its own idle run beside it, named by `pair`
    idle = {(load_key(r), r["rep"], r.get("pair")): r.get(key) for r in runs
            if r["mode"] == "idle"}
    out: dict[str, dict[str, dict]] = {}
    for r in runs:
        base = idle.get((load_key(r), r["rep"], r.get("pair")))
        if r["mode"] == "idle" or not base or not r.get(key):
            continue
        ratios = [m / b for m, b in zip(r[key], base) if m and b]
        if not ratios:
            continue
        cell = out.setdefault(r["mode"], {}).setdefault(load_key(r), {"reps": [], "_by": []})
        cell["reps"].append(round((statistics.median(ratios) - 1) * 100, 2))
        cell["_by"].append(ratios)
    for by_load in out.values():
        for cell in by_load.values():
            by_rep = cell.pop("_by")
            cell["pooled"] = _pct(statistics.median([x for rep in by_rep for x in rep]))
            if ci:
                cell["ci95"] = bootstrap_ci(by_rep)
    return out


def _pct(ratio: float) -> float:
    return round((ratio - 1) * 100, 2)


def bootstrap_ci(by_rep: list[list[float]], n: int = 1000, seed: int = 0,
                 as_pct: bool = True) -> list[float]:
    """95 % interval of the pooled median (of ratios, in %; as_pct False: of values, as
    they are, e.g. ms), resampling whole repetitions: the requests of one repetition met
    one host state and one batch mix, so they are not independent, and resampling
    requests would claim a precision the runs do not have."""
    rng = random.Random(seed)  # seeded: a report reads the same twice
    medians = sorted(
        statistics.median([x for i in rng.choices(range(len(by_rep)), k=len(by_rep))
                           for x in by_rep[i]])
        for _ in range(n))
    ends = medians[int(0.025 * n)], medians[int(0.975 * n) - 1]
    return [_pct(x) if as_pct else round(x, 2) for x in ends]


def ttft_by_position(runs: list[dict], base: str = "idle") -> dict:
    """TTFT of bursts (every request at once) per load and mode against `base`, from each
    run's ttft_ms_by_request. A burst's requests are admitted in order, so TTFT grows
    with the position (the engine takes requests as they arrive): `slope_ms`, the median
    over repetitions of a least-squares fit per run, is the time each request adds, the
    per-request admission cost included; `paired_ms`, request i's TTFT in the mode
    minus request i's in `base` in the same repetition, median over positions and
    repetitions, is the mode's added latency at equal position (`paired_ci95_ms`: its
    95 % interval over repetitions); `median_ms` is the
    median of the runs' medians; `phases_ms`, per phase (ttft_phases) the median over
    the requests of every repetition, where the runs recorded them, and `phases_paired_ms`
    each phase paired by position like `paired_ms` (whole-burst phase medians move by tens
    of ms between repetitions; the paired differences show where a mode's time goes)."""
    by: dict[tuple[str, str], dict[int, list[float]]] = {}
    phases_by: dict[tuple[str, str], dict[int, list]] = {}  # ttft_phases, per repetition
    for r in runs:
        if str(r["rate"]).startswith("burst") and r.get("ttft_ms_by_request"):
            by.setdefault((str(r["rate"]), r["mode"]), {})[r["rep"]] = r["ttft_ms_by_request"]
            if r.get("ttft_phases_ms_by_request"):
                phases_by.setdefault((str(r["rate"]), r["mode"]), {})[r["rep"]] = \
                    r["ttft_phases_ms_by_request"]
    out: dict[str, dict[str, dict]] = {}
    for (load, mode), reps in sorted(by.items()):
        ref = by.get((load, base), {})
        by_rep = [[a - b for a, b in _by_position({rep: t}, ref)] for rep, t in reps.items()]
        paired = [x for r in by_rep for x in r]
        slopes = [float(np.polyfit(np.arange(len(t)), t, 1)[0]) for t in reps.values()
                  if None not in t and len(t) > 1]
        phases = [p for t in phases_by.get((load, mode), {}).values() for p in t if p]
        out.setdefault(load, {})[mode] = {
            "reps": len(reps),
            "median_ms": statistics.median(statistics.median(x for x in t if x is not None)
                                           for t in reps.values()),
            "paired_ms": statistics.median(paired) if paired else None,
            "paired_ci95_ms": bootstrap_ci([r for r in by_rep if r], as_pct=False)
            if paired else None,
            "slope_ms": statistics.median(slopes) if slopes else None,
            "phases_ms": {k: statistics.median(p[k] for p in phases)
                          for k in PHASES} if phases else None,
            "phases_paired_ms": _paired_phases(phases_by.get((load, mode), {}),
                                               phases_by.get((load, base), {}))}
    return out


def _paired_phases(reps: dict[int, list], ref: dict[int, list]) -> dict | None:
    """Per phase, the median over positions and repetitions of request i's phase in a
    mode minus request i's in the base run of the same repetition."""
    pairs = list(_by_position(reps, ref))
    return {k: statistics.median(a[k] - b[k] for a, b in pairs) for k in PHASES} \
        if pairs else None


def _by_position(reps: dict[int, list], ref: dict[int, list]):
    """(request i in a mode, request i in the base run) of every repetition both ran,
    where both have a figure."""
    return ((a, b) for rep, t in reps.items() if rep in ref
            for a, b in zip(t, ref[rep]) if a is not None and b is not None)


def report(results_dir: Path) -> str:
    runs = {}
    for f in sorted(results_dir.glob("tpot-*.json")):
        if f.stem.endswith("-quick"):
            continue
        d = json.loads(f.read_text())
        if "summary_tpot_ms" not in d:
            summarise(d)
        for mode, by_rate in d["summary_tpot_ms"].items():
            runs[(d["model"], "stock" if d["variant"] == "stock" else f"graphtap {mode}")] = (by_rate, d)
    columns = ["1", "4", "8", "16"] + sorted(
        {k for by_rate, _ in runs.values() for k in by_rate if k.startswith("burst")},
        key=lambda k: int(k[5:]))
    heads = [f"{c} req/s" if not c.startswith("burst") else f"{c[5:]} at once" for c in columns]
    lines = ["| model | variant | " + " | ".join(heads) + " |",
             "|---|---|" + "---|" * len(columns)]
    for (model, variant), (by_rate, d) in sorted(runs.items()):
        base = runs.get((model, "stock"), (None,))[0]
        cells = []
        for rate in columns:
            if rate not in by_rate:
                cells.append("–")
                continue
            v = by_rate[rate]
            if base and rate in base and variant != "stock":
                cells.append(f"{v:.2f} ms ({(v / base[rate] - 1) * 100:+.2f} %)")
            else:
                cells.append(f"{v:.2f} ms")
        lines.append(f"| {model} | {variant} | " + " | ".join(cells) + " |")
    any_d = next(iter(runs.values()), (None, {}))[1]
    md = (f"Median TPOT (median of repetitions; in brackets: vs stock, same model), "
          f"{any_d.get('input_len')} in / {any_d.get('output_len')} out tokens, GPU: "
          f"{any_d.get('gpu')}\n\n" + "\n".join(lines) + "\n")
    (results_dir / "tpot.md").write_text(md)
    return md
