"""Figures of bench_tpot.py runs: median TPOT per mode and load, and each mode's overhead
vs idle paired per request (shared by bench_tpot.py and capture_report.py), and the TTFT
of bursts by admission position."""
from __future__ import annotations

import random
import statistics

import numpy as np


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


def bootstrap_ci(by_rep: list[list[float]], n: int = 1000, seed: int = 0) -> list[float]:
    """95 % interval of the pooled median ratio (in %), resampling whole repetitions: the
    requests of one repetition met one host state and one batch mix, so they are not
    independent, and resampling requests would claim a precision the runs do not have."""
    rng = random.Random(seed)  # seeded: a report reads the same twice
    medians = sorted(
        statistics.median([x for i in rng.choices(range(len(by_rep)), k=len(by_rep))
                           for x in by_rep[i]])
        for _ in range(n))
    return [_pct(medians[int(0.025 * n)]), _pct(medians[int(0.975 * n) - 1])]


def ttft_by_position(runs: list[dict], base: str = "idle") -> dict:
    """TTFT of bursts (every request at once) per load and mode against `base`, from each
    run's ttft_ms_by_request. A burst's requests are admitted in order, so TTFT grows
    with the position (the engine takes requests as they arrive): `slope_ms`, the median
    over repetitions of a least-squares fit per run, is the time each request adds, the
    per-request admission cost included; `paired_ms`, request i's TTFT in the mode
    minus request i's in `base` in the same repetition, median over positions and
    repetitions, is the mode's added latency at equal position; `median_ms` is the
    median of the runs' medians."""
    by: dict[tuple[str, str], dict[int, list[float]]] = {}
    for r in runs:
        if str(r["rate"]).startswith("burst") and r.get("ttft_ms_by_request"):
            by.setdefault((str(r["rate"]), r["mode"]), {})[r["rep"]] = r["ttft_ms_by_request"]
    out: dict[str, dict[str, dict]] = {}
    for (load, mode), reps in sorted(by.items()):
        ref = by.get((load, base), {})
        paired = [a - b for rep, t in reps.items() if rep in ref
                  for a, b in zip(t, ref[rep]) if a is not None and b is not None]
        slopes = [float(np.polyfit(np.arange(len(t)), t, 1)[0]) for t in reps.values()
                  if None not in t and len(t) > 1]
        out.setdefault(load, {})[mode] = {
            "reps": len(reps),
            "median_ms": statistics.median(statistics.median(x for x in t if x is not None)
                                           for t in reps.values()),
            "paired_ms": statistics.median(paired) if paired else None,
            "slope_ms": statistics.median(slopes) if slopes else None}
    return out
