#!/usr/bin/env python3
"""Capture overhead vs idle as a markdown table, from one or more bench_tpot.py launches of
one model (modes alternating, e.g. `--modes idle,hs,qk,mixed --burst-modes dump`).

A cell is the paired overhead vs idle (bench_tpot.paired_overheads: per request, its TPOT
in that mode over its TPOT in idle in the same repetition), pooled over every repetition of
every file, then the range of the repetitions' medians and their count. The idle row gives
idle's median TPOT (median of repetitions).

    python3 benchmarks/gpu/capture_report.py benchmarks/results/capture-llama3-8b-s4-*.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_tpot import summarise  # noqa: E402

MODES = ["idle2", "hs", "qk", "mixed", "steer", "dump"]  # idle2: the A/A control


def column_order(key: str) -> tuple[int, float]:
    return (1, float(key[5:])) if key.startswith("burst") else (0, float(key))


def table(files: list[Path]) -> str:
    runs, models = [], set()
    for i, f in enumerate(files):
        d = json.loads(f.read_text())
        models.add(d["model"])
        runs += [{**r, "rep": (i, r["rep"])} for r in d["runs"]]  # reps differ per file
    merged = {"runs": runs}
    summarise(merged)  # the same figures bench_tpot.py writes per launch, over all files
    overhead, idle = merged["summary_overhead_vs_idle_pct"], merged["summary_tpot_ms"]["idle"]
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
                         f" n={len(c['reps'])}")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    files = [Path(a) for a in sys.argv[1:]]
    if not files:
        print(__doc__)
        return 2
    print(table(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
