"""Figures of bench_tpot.py runs: median TPOT per mode and load, and each mode's overhead
vs idle paired per request (shared by bench_tpot.py and capture_report.py)."""
from __future__ import annotations

import statistics


def summarise(result: dict) -> None:
    summary: dict[str, dict[str, float]] = {}
    for r in result["runs"]:
        key = load_key(r)
        summary.setdefault(r["mode"], {}).setdefault(key, []).append(r["tpot_ms_median"])
    result["summary_tpot_ms"] = {m: {k: statistics.median(v) for k, v in d.items()}
                                 for m, d in summary.items()}
    result["summary_overhead_vs_idle_pct"] = paired_overheads(result["runs"])
    engine = paired_overheads(result["runs"], ENGINE)
    if engine:  # launches from before the engine-clock figure have none
        result["summary_overhead_vs_idle_pct_engine"] = engine


def load_key(r: dict) -> str:
    return r["rate"] if isinstance(r["rate"], str) else f"{r['rate']:g}"


FRONTEND = "tpot_ms_by_request"  # per-request TPOT from token arrival in the client
ENGINE = "tpot_engine_ms_by_request"  # the same from the engine core's output timestamps


def paired_overheads(runs: list[dict], key: str = FRONTEND) -> dict:
    """Per mode and load: the overhead vs idle from per-request TPOT ratios (request i has
    the same arrival and prompt in both), per repetition (median of its ratios) and pooled
    (median of every repetition's ratios), in %. Far less noisy than comparing two runs'
    medians, whose requests met different batch mixes in different repetitions."""
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
        cell = out.setdefault(r["mode"], {}).setdefault(load_key(r), {"reps": [], "_all": []})
        cell["reps"].append(round((statistics.median(ratios) - 1) * 100, 2))
        cell["_all"] += ratios
    for by_load in out.values():
        for cell in by_load.values():
            cell["pooled"] = round((statistics.median(cell.pop("_all")) - 1) * 100, 2)
    return out
