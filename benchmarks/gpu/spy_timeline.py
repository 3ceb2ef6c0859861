"""The engine core's main thread as a timeline per burst, from spy_burst.sh's
SPY_TIMELINE=1 trace (py-spy's Chrome trace, waiting included): what the loop did, in
order, between a burst's first request and its end, each span labelled by the deepest
function of a short list (graphtap's per-step parts, the scheduler, the wait for the
device's copy event, the wait for input). A burst is a stretch of work between waits for
input longer than `--gap` ms (the loop blocks on input only
between bursts); bursts whose samples touch a capture family are `capture`
bursts, the others `plain`. Printed: per kind the median ms per label per burst, then
the first bursts' spans in order.

    python -m benchmarks.gpu.spy_timeline OUT/engine.json.gz [--gap 30] [--show 2]
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict

# (function name suffix, label), the deepest match of a sample's stack wins
LABELS = (
    ("run_busy_loop", "loop"),
    ("_process_input_queue", "input"),
    ("Queue.get", "wait_input"),
    ("Scheduler.schedule", "schedule"),
    ("execute_model", "execute"),
    ("sample_tokens", "sample"),
    ("Scheduler.update_from_output", "update"),
    ("Future.result", "result"),
    ("get_output", "get_output"),
    ("Event.synchronize", "wait_device"),
    ("EngineHooks.add_request", "gt.add"),
    ("EngineHooks.apply_staged_writes", "gt.apply"),
    ("EngineHooks.prepare_step", "gt.prepare"),
    ("EngineHooks.collect", "gt.collect"),
    ("StepSnapshots.to_cpu_nonblocking", "gt.to_cpu"),
    ("StepSnapshots.per_request", "gt.split"),
    ("collective_rpc", "rpc"),
)
CAPTURE_MARK = ("CaptureFamily.route",)


def samples(path: str):
    """(ts_us, stack of function names root first) per change of the main thread's
    stack (the thread whose stacks hold run_busy_loop)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)
    stacks: dict[int, list[str]] = defaultdict(list)
    out: dict[int, list[tuple[float, tuple[str, ...]]]] = defaultdict(list)
    for e in sorted(events, key=lambda e: (e["ts"], e["ph"] == "B")):  # ends first
        st = stacks[e["tid"]]
        if e["ph"] == "B":
            st.append(e["name"])
        elif e["ph"] == "E" and st:
            st.pop()
        seq = out[e["tid"]]
        if seq and seq[-1][0] == e["ts"]:
            seq[-1] = (e["ts"], tuple(st))
        else:
            seq.append((e["ts"], tuple(st)))
    main = max(out, key=lambda t: sum("run_busy_loop" in " ".join(s) for _, s in out[t][:5000]))
    return out[main]


def label(stack: tuple[str, ...]) -> str:
    best = "other"
    for name in stack:
        for suffix, lab in LABELS:
            if name.endswith(suffix):
                best = lab
    return best


def spans(seq) -> list[tuple[float, float, str, bool]]:
    """(start ms, duration ms, label, capture mark) merged over consecutive samples."""
    out: list[list] = []
    for (ts, st), (nxt, _) in zip(seq, seq[1:]):
        lab, mark = label(st), any(n.endswith(CAPTURE_MARK) for n in st)
        if out and out[-1][2] == lab:
            out[-1][1] = (nxt - out[-1][0] * 1000) / 1000
            out[-1][3] |= mark
        else:
            out.append([ts / 1000, (nxt - ts) / 1000, lab, mark])
    return [tuple(s) for s in out]


def bursts(sp, gap_ms: float):
    """Runs of spans between input waits longer than gap_ms."""
    cur: list = []
    for s in sp:
        if s[2] == "wait_input" and s[1] > gap_ms:
            if cur:
                yield cur
            cur = []
        else:
            cur.append(s)
    if cur:
        yield cur


def summary(trace: str, gap_ms: float = 5.0) -> dict[str, dict]:
    """Per kind of burst (capture / plain): how many, the median ms per label per burst,
    and the bursts' spans."""
    by_kind: dict[str, list] = defaultdict(list)
    for b in bursts(spans(samples(trace)), gap_ms):
        if sum(s[1] for s in b) > 5:  # a burst, not the RPCs between them
            by_kind["capture" if any(s[3] for s in b) else "plain"].append(b)
    out = {}
    for kind, bs in by_kind.items():
        totals = defaultdict(list)
        for b in bs:
            per = defaultdict(float)
            for s in b:
                per[s[2]] += s[1]
            for lab in {lab for _, lab in LABELS} | {"other"}:
                totals[lab].append(per.get(lab, 0.0))
        out[kind] = {"bursts": len(bs), "spans": bs,
                     "median_ms": {lab: round(statistics.median(v), 2)
                                   for lab, v in sorted(totals.items())
                                   if statistics.median(v) >= 0.05}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--gap", type=float, default=5.0)
    ap.add_argument("--show", type=int, default=2)
    args = ap.parse_args()
    for kind, k in summary(args.trace, args.gap).items():
        print(f"{kind}: {k['bursts']} bursts, ms per burst (median): " +
              ", ".join(f"{lab} {ms:.1f}" for lab, ms in k["median_ms"].items()))
        for b in k["spans"][:args.show]:
            t0 = b[0][0]
            print("  " + " | ".join(f"{s[0] - t0:.1f}+{s[1]:.1f} {s[2]}" for s in b
                                    if s[1] >= 0.3))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
