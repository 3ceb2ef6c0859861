"""Sums py-spy's raw samples (spy_burst.sh: --threads, --full-filenames) per thread: all
of a thread's samples, those inside graphtap's code (a frame whose file is under a
graphtap/ folder), and per function where graphtap's time went (the outermost graphtap
frame of each sample) and where the thread's time went (the frame `depth` levels below
the thread's root). At 1000 Hz a sample is a millisecond of the thread's running time.

    python -m benchmarks.gpu.spy_report OUT/engine.txt [--depth 6] [--top 15]
"""
from __future__ import annotations

import argparse
import json
import re
from collections import Counter

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*):\d+\)$")


def parse(path: str):
    """(thread name, frames [(function, file)] root first, samples) per line."""
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        parts = stack.split(";")
        thread = parts[0].split(": ", 1)[-1]
        frames = [(m["func"], m["file"]) if (m := FRAME.match(p)) else (p, "")
                  for p in parts[1:]]
        yield thread, frames, int(count)


def report(path: str, depth: int = 6, top: int = 15) -> dict:
    threads: dict[str, dict] = {}
    for thread, frames, n in parse(path):
        t = threads.setdefault(thread, {"samples": 0, "graphtap": 0, "in_graphtap": Counter(),
                                        "at_depth": Counter()})
        t["samples"] += n
        ours = next((f for f in frames if "/graphtap/" in f[1]), None)
        if ours is not None:
            t["graphtap"] += n
            t["in_graphtap"][f"{ours[0]} ({ours[1].rsplit('/graphtap/', 1)[-1]})"] += n
        if frames:
            func, file = frames[min(depth, len(frames) - 1)]
            t["at_depth"][f"{func} ({file.rsplit('/', 1)[-1]})"] += n
    return {name: {"samples": t["samples"], "graphtap": t["graphtap"],
                   "graphtap_pct": round(100 * t["graphtap"] / max(t["samples"], 1), 2),
                   "in_graphtap": dict(t["in_graphtap"].most_common(top)),
                   "at_depth": dict(t["at_depth"].most_common(top))}
            for name, t in sorted(threads.items(), key=lambda kv: -kv[1]["samples"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    print(json.dumps(report(args.path, args.depth, args.top), indent=1))


if __name__ == "__main__":
    main()
