"""Where the hook manager's host time goes.

Named host ranges for torch.profiler (benchmarks/gpu/profile_capture.py reads them),
at no cost when no profiler runs: torch.profiler.record_function costs a few
microseconds even then, and the hook manager opens several per step, on the critical
path of every request of the engine (benchmarks/cpu: test_named_range_off).

HostClock: per phase of a step, on the thread that runs it (the engine core's busy loop
at TP=1), wall time, the thread's own CPU time, and the calls that took 1 ms or more,
always on. Wall above CPU is time the thread waited: for the GIL, which every torch
call releases and another thread of the process (the engine core's input thread
decoding a burst's requests) may then hold for up to its switch interval; or for the
device. GET /v1/graphtap/stats shows the counters (`host.<phase>_*_total`), and
benchmarks/gpu/bench_tpot.py records them per run. One clock per engine (EngineHooks
owns it, its StepSnapshots borrow it), never a module global, which two engines of one
process would share.

It also keeps the last TIMELINE calls as a timeline (phase, start, wall time), on
CLOCK_MONOTONIC: the clock of vLLM's request timestamps (scheduled, first token), so a
request's first-token window can be laid over the phases that ran in it
(benchmarks/gpu/first_token.py).

watch_gc() adds the process's garbage collections to it ("gc0".."gc2", timeline and
stats): a collection holds the GIL, so it stops the busy loop whichever of the
engine core's threads set it off, and a hooked burst allocates more objects than a
plain one."""
from __future__ import annotations

import contextlib
import gc
import time
import weakref
from collections import defaultdict, deque

import torch

_OFF = contextlib.nullcontext()


def named(name: str):
    """`with named("graphtap.x"):` a profiler range while a profiler runs, else nothing."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _OFF


SLOW_NS = 1_000_000  # a call this long is counted apart: one stall shows up in the totals
TIMELINE = 8192  # phase calls the timeline keeps (a burst of 64 makes some 400)


class _Phase:
    """`with clock.phase("x"):` adds one call. Not reentrant: one phase runs at a time
    on the engine's thread, and a nested phase of the same name would count twice."""

    __slots__ = ("_clock", "_name", "_wall", "_cpu")

    def __init__(self, clock: "HostClock", name: str):
        self._clock, self._name = clock, name

    def __enter__(self) -> None:
        self._wall, self._cpu = time.perf_counter_ns(), time.thread_time_ns()

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter_ns() - self._wall
        self._clock.add(self._name, wall, time.thread_time_ns() - self._cpu)
        self._clock.calls.append((self._name, self._wall, wall))


class HostClock:
    """One engine's host time per phase (see the module's docstring)."""

    def __init__(self) -> None:
        self._phases: dict[str, _Phase] = {}
        self._wall: defaultdict[str, int] = defaultdict(int)
        self._cpu: defaultdict[str, int] = defaultdict(int)
        self._calls: defaultdict[str, int] = defaultdict(int)
        self._slow: defaultdict[str, int] = defaultdict(int)
        # (phase, start, wall) in ns, start on perf_counter: CLOCK_MONOTONIC on Linux
        self.calls: deque[tuple[str, int, int]] = deque(maxlen=TIMELINE)
        self._gc: GcWatch | None = None

    def phase(self, name: str) -> _Phase:
        p = self._phases.get(name)
        if p is None:
            p = self._phases[name] = _Phase(self, name)
        return p

    def add(self, name: str, wall_ns: int, cpu_ns: int) -> None:
        self._wall[name] += wall_ns
        self._cpu[name] += cpu_ns
        self._calls[name] += 1
        if wall_ns >= SLOW_NS:
            self._slow[name] += 1

    def watch_gc(self) -> None:
        """Time this process's collections too (GcWatch), while this clock lives."""
        if self._gc is None:
            self._gc = GcWatch()
            self._gc.register()

    def timeline(self) -> list[tuple[str, float, float]]:
        """The calls since the last look, oldest first: (phase, start in seconds of
        time.monotonic, wall ms); the timeline is empty after."""
        calls = _drain(self.calls)
        if self._gc is not None:
            calls = sorted(calls + _drain(self._gc.calls), key=lambda c: c[1])
        return [(name, start / 1e9, wall / 1e6) for name, start, wall in calls]

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name in sorted(self._calls):
            out[f"{name}_calls_total"] = self._calls[name]
            out[f"{name}_wall_ms_total"] = round(self._wall[name] / 1e6, 3)
            out[f"{name}_cpu_ms_total"] = round(self._cpu[name] / 1e6, 3)
            out[f"{name}_over_1ms_total"] = self._slow[name]
        if self._gc is not None:
            for g, (calls, wall) in enumerate(zip(self._gc.count, self._gc.wall_ns)):
                out[f"gc{g}_calls_total"] = calls
                out[f"gc{g}_wall_ms_total"] = round(wall / 1e6, 3)
        return out


class GcWatch:
    """The process's garbage collections, timed (gc.callbacks), for one clock. Kept apart
    from the clock's phase counters: a collection, and so this callback, can start in
    any allocation, also one made while those counters are being read. The callback
    holds the watch weakly: an engine that is gone leaves a no-op behind, which the
    next registration drops."""

    def __init__(self) -> None:
        self._start = 0
        self.count = [0, 0, 0]
        self.wall_ns = [0, 0, 0]
        self.calls: deque[tuple[str, int, int]] = deque(maxlen=TIMELINE)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter_ns()
        elif self._start:
            wall = time.perf_counter_ns() - self._start
            g = info["generation"]
            self.count[g] += 1
            self.wall_ns[g] += wall
            self.calls.append((_GC_NAMES[g], self._start, wall))
            self._start = 0

    def register(self) -> None:
        ref = weakref.ref(self)

        def callback(phase: str, info: dict) -> None:
            watch = ref()
            if watch is not None:
                watch(phase, info)
        callback.graphtap_watch = ref
        gc.callbacks[:] = [c for c in gc.callbacks
                           if getattr(c, "graphtap_watch", _not_ours)() is not None]
        gc.callbacks.append(callback)


_GC_NAMES = ("gc0", "gc1", "gc2")


def _drain(calls: deque) -> list:
    """A timeline deque's entries, oldest first, taken out one by one: a gc callback
    may append while this runs, and what it appends stays for the next look."""
    return [calls.popleft() for _ in range(len(calls))]


def _not_ours() -> bool:  # another library's callback: kept
    return True
