#!/usr/bin/env python3
"""Capture overhead vs idle as a markdown table, from one or more bench_tpot.py launches of
one model (modes alternating, e.g. `--modes idle,hs,qk,mixed --burst-modes dump`).

A cell is the paired overhead vs idle (tpot_stats.paired_overheads: per request, its TPOT
in that mode over its TPOT in idle in the same repetition), pooled over every repetition of
every file, then the range of the repetitions' medians and their count. The idle row gives
idle's median TPOT (median of repetitions). Below the table: each target's worst cell,
and the A/A control's (mode idle2) worst cell, the measurement's own noise.

With --engine the cells use TPOT on the engine core's clock (tpot_engine_ms_by_request,
recorded by bench_tpot.py since session 6's launches), leaving the client's delays out.
With --ci each cell adds the pooled figure's 95 % interval, from a bootstrap that
resamples whole repetitions (tpot_stats.bootstrap_ci).

    python -m benchmarks.gpu.capture_report benchmarks/results/capture-llama3-8b-s5-*.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


from benchmarks.gpu.tpot_stats import summarise

MODES = ["idle2", "hs", "qk", "mixed", "steer", "dump", "focus", "probe"]  # idle2: A/A
# TPOT overhead vs idle, %, at every load: issue 4 (hs, qk), issue 17 (guards)
TARGETS = {"hs": 2.5, "qk": 3.5, "focus": 1.0, "probe": 1.0}


def verdict(overhead: dict) -> str:
    """The worst pooled cell of each targeted mode against its target, and the A/A
    control's worst |pooled| cell: where that exceeds a target, the runs cannot show it."""
    lines = []
    noise = max((abs(c["pooled"]) for c in overhead.get("idle2", {}).values()), default=None)
    for mode, target in TARGETS.items():
        if mode not in overhead:
            continue
        worst_key, worst = max(((k, c["pooled"]) for k, c in overhead[mode].items()),
                               key=lambda kv: kv[1])
        state = "met" if worst <= target else "not met"
        if noise is not None and noise > target:
            state += f" (A/A noise {noise:.1f} % > target: not resolvable)"
        lines.append(f"- {mode}: worst {worst:+.1f} % at {worst_key} vs ≤ {target} %: {state}")
    if noise is not None:
        lines.append(f"- A/A control (idle2 vs idle): worst |pooled| {noise:.1f} %")
    return "\n".join(lines) + ("\n" if lines else "")


def column_order(key: str) -> tuple[int, float]:
    return (1, float(key[5:])) if key.startswith("burst") else (0, float(key))


def merged(files: list[Path], ci: bool = False) -> tuple[dict, set[str]]:
    """Every file's runs as one launch (repetitions kept apart per file), summarised as
    bench_tpot.py summarises a launch (with ci, each cell's interval too); and the models
    they measured."""
    runs, models = [], set()
    for i, f in enumerate(files):
        d = json.loads(f.read_text())
        models.add(d["model"])
        runs += [{**r, "rep": (i, r["rep"])} for r in d["runs"]]
    result = {"runs": runs}
    summarise(result, ci)
    return result, models


def table(files: list[Path]) -> str:
    return render(*merged(files))


def overheads(result: dict, engine: bool = False) -> dict:
    """The paired overheads of merged() launches, on the client's or the engine's clock."""
    key = "summary_overhead_vs_idle_pct" + ("_engine" if engine else "")
    if key not in result:
        raise SystemExit("these launches carry no engine-clock TPOT "
                         "(tpot_engine_ms_by_request): run without --engine")
    return result[key]


def render(result: dict, models: set[str], engine: bool = False) -> str:
    """The table of merged() launches (cells add their interval where merged(ci=True))."""
    overhead = overheads(result, engine)
    idle = result["summary_tpot_ms"]["idle"]
    loads = sorted(idle, key=column_order)
    heads = [f"{k[5:]} at once" if k.startswith("burst") else f"{k} req/s" for k in loads]
    lines = [f"| {'/'.join(sorted(models))} | " + " | ".join(heads) + " |",
             "|---|" + "---|" * len(loads),
             "| idle TPOT | " + " | ".join(f"{idle[k]:.2f} ms" for k in loads) + " |"]
    for mode in [m for m in MODES if m in overhead]:
        cells = []
        for k in loads:
            c = overhead[mode].get(k)
            cells.append("–" if c is None else
                         f"{c['pooled']:+.1f} % [{min(c['reps']):+.1f}, {max(c['reps']):+.1f}]"
                         f" n={len(c['reps'])}"
                         + (f" (95 % CI {c['ci95'][0]:+.1f}, {c['ci95'][1]:+.1f})"
                            if "ci95" in c else ""))
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--engine", action="store_true",
                    help="TPOT from the engine core's output timestamps")
    ap.add_argument("--ci", action="store_true",
                    help="each cell's 95 %% interval (bootstrap over repetitions)")
    args = ap.parse_args()
    result, models = merged(args.files, args.ci)  # read and summarised once for both
    print(render(result, models, args.engine))
    print(verdict(overheads(result, args.engine)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
