"""A burst's first token, laid over the hook manager's phase calls (issue 18): request 0's
window on the engine core's clock, from its scheduling to the output of its first token
(RequestOutput.metrics), and the phases of graphtap's host clock that ran in it
(profiling.HostClock's timeline, fetched after each burst). Per mode, paired by
repetition against a base mode: how much longer the window is, and how much of that is
graphtap's own host work; the rest lies outside graphtap's phases (vLLM's own steps,
the device, waits for the GIL between the phases).

With async scheduling the window spans the step that admits the next requests too: the
engine core builds step N's outputs after it has scheduled and launched step N + 1."""
from __future__ import annotations

import statistics

# the hook manager's phases that do not nest in another (prepare_step holds
# prepare_plan, prepare_route_tokens and prepare_route_rows); per_request runs on
# vLLM's async output thread, split_later (a step's split after its tokens left,
# courier/later.py) on the engine core's output thread, the others on its busy loop
TOP = ("add_request", "remove_request", "apply_staged_writes", "prepare_step", "collect",
       "to_cpu", "per_request", "split_later")
OFF_LOOP = ("per_request", "split_later")


def marks(out) -> list[float] | None:
    """[scheduled, first token] of a request on the engine core's clock (seconds)."""
    m = getattr(out, "metrics", None)
    if m is None or not getattr(m, "scheduled_ts", 0) or not getattr(m, "first_token_ts", 0):
        return None
    return [m.scheduled_ts, m.first_token_ts]


async def fetch_timeline(engine, since: float, until: float = float("inf")) -> list | None:
    """The workers' phase calls since the last fetch, those that started between `since`
    and `until` (seconds of time.monotonic); None from an engine without graphtap's
    worker extension."""
    try:
        calls = (await engine.collective_rpc("graphtap_host_timeline"))[0]
    except Exception:  # a stock engine, or an older overlay
        return None
    return _between(calls, since, until)


def _between(calls, since: float, until: float = float("inf")) -> list:
    """HostClock.timeline's calls that started between `since` and `until`, rounded."""
    return [[name, round(start, 6), round(ms, 4)] for name, start, ms in calls
            if since <= start <= until]


def frontend_timeline(engine, since: float) -> list | None:
    """This process's graphtap frontend's phase calls since `since` (the output
    handler's finish and arrived, the split thread's split: GraphtapFrontend.host_timeline),
    None without one."""
    hooks = getattr(getattr(engine, "input_processor", None), "hooks", None)
    if not hasattr(hooks, "host_timeline"):
        return None
    return _between(hooks.host_timeline(), since)


def window(run: dict) -> dict | None:
    """Request 0's window (ms) and the ms of each top-level phase inside it, with their
    sum on the busy loop (`main`); per_request and split_later run on other threads."""
    m = (run.get("ttft_marks_by_request") or [None])[0]
    calls = run.get("host_timeline")
    if not m or calls is None:
        return None
    lo, hi = m
    out = dict.fromkeys(TOP, 0.0)
    for name, start, ms in calls:
        if name in out:
            end = start + ms / 1e3
            out[name] += max(0.0, min(end, hi) - max(start, lo)) * 1e3
    out["main"] = sum(v for k, v in out.items() if k in TOP and k not in OFF_LOOP)
    out["window"] = (hi - lo) * 1e3
    return out


def first_token_window(runs: list[dict], base: str = "idle") -> dict:
    """Per burst load and mode: the median over repetitions of request 0's window and of
    graphtap's phases in it (`ms`), and of each minus the base mode's in the same
    repetition (`paired_ms`); `outside_ms`: the paired window less the paired main and
    per_request, what graphtap's phases do not account for."""
    by: dict[tuple[str, str], dict[int, dict]] = {}
    for r in runs:
        w = window(r) if str(r.get("rate", "")).startswith("burst") else None
        if w is not None:
            by.setdefault((str(r["rate"]), r["mode"]), {})[r["rep"]] = w
    out: dict[str, dict[str, dict]] = {}
    for (load, mode), reps in sorted(by.items()):
        ref = by.get((load, base), {})
        keys = list(next(iter(reps.values())))
        entry = {"reps": len(reps),
                 "ms": {k: round(statistics.median(w[k] for w in reps.values()), 3)
                        for k in keys}}
        pairs = [(w, ref[rep]) for rep, w in reps.items() if rep in ref]
        if pairs and mode != base:
            paired = {k: statistics.median(a[k] - b[k] for a, b in pairs) for k in keys}
            entry["paired_ms"] = {k: round(v, 3) for k, v in paired.items()}
            entry["outside_ms"] = round(statistics.median(
                (a["window"] - b["window"]) - (a["main"] - b["main"]) -
                (a["per_request"] - b["per_request"]) for a, b in pairs), 3)
        out.setdefault(load, {})[mode] = entry
    return out
