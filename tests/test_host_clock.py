"""HostClock (graphtap/profiling.py): the hook manager's host time per phase, wall and
the thread's own CPU time, kept per engine."""
import time

from graphtap.profiling import HostClock


def test_phases_count_calls_wall_cpu_and_slow_calls():
    # Only what holds on a loaded machine: a preempted call of microseconds may take
    # over 1 ms of wall time (it did once in CI), so the threshold is checked apart
    clock = HostClock()
    for _ in range(3):
        with clock.phase("prepare_step"):
            sum(range(1000))
    with clock.phase("per_request"):
        time.sleep(0.005)  # waiting: wall time the thread did not spend on CPU
    s = clock.stats()
    assert s["prepare_step_calls_total"] == 3 and s["per_request_calls_total"] == 1
    assert s["per_request_over_1ms_total"] == 1
    assert s["per_request_wall_ms_total"] >= 5.0
    assert s["per_request_cpu_ms_total"] < s["per_request_wall_ms_total"] - 3.0
    assert 0 < s["prepare_step_cpu_ms_total"] <= s["prepare_step_wall_ms_total"] + 0.5
    assert all(k.endswith("_total") for k in s)  # bench_tpot records *_total keys per run


def test_a_call_of_1ms_or_more_is_counted_slow():
    clock = HostClock()
    clock.add("collect", 999_999, 999_999)
    clock.add("collect", 1_000_000, 10)
    clock.add("collect", 2_500_000, 2_400_000)
    s = clock.stats()
    assert s["collect_calls_total"] == 3 and s["collect_over_1ms_total"] == 2
    assert s["collect_wall_ms_total"] == 4.5 and s["collect_cpu_ms_total"] == 3.4


def test_a_phase_that_raises_is_still_counted_and_the_error_goes_on():
    clock = HostClock()
    try:
        with clock.phase("add_request"):
            raise ValueError("bad spec")
    except ValueError:
        pass
    assert clock.stats()["add_request_calls_total"] == 1


def test_two_engines_keep_their_own_counts():
    a, b = HostClock(), HostClock()
    with a.phase("collect"):
        pass
    assert a.stats()["collect_calls_total"] == 1 and b.stats() == {}


def test_the_timeline_holds_each_call_on_the_requests_clock_until_read():
    """Each call as (phase, start, wall ms), its start on time.monotonic (the clock of
    vLLM's request timestamps), oldest first; read once, then empty; bounded."""
    from graphtap.profiling import TIMELINE

    clock = HostClock()
    before = time.monotonic()
    with clock.phase("add_request"):
        time.sleep(0.002)
    with clock.phase("prepare_step"):
        pass
    after = time.monotonic()
    calls = clock.timeline()
    assert [c[0] for c in calls] == ["add_request", "prepare_step"]
    assert before <= calls[0][1] <= calls[1][1] <= after
    assert calls[0][2] >= 2.0 and calls[1][1] >= calls[0][1] + calls[0][2] / 1e3
    assert clock.timeline() == []
    for _ in range(TIMELINE + 5):
        with clock.phase("collect"):
            pass
    assert len(clock.timeline()) == TIMELINE


def test_garbage_collections_join_the_timeline_and_the_counts():
    """watch_gc: each collection of the process as a phase gc0..gc2 (start and wall on
    the timeline's clock, among the phases by start; calls and wall in stats), for
    every watching clock; a clock that is gone leaves no callback behind once another
    registers."""
    import gc

    def ours(live=True):  # other tests' engines of this process may have left theirs
        return [c for c in gc.callbacks if hasattr(c, "graphtap_watch")
                and (not live or c.graphtap_watch() is not None)]

    before = len(ours())
    a, b = HostClock(), HostClock()
    a.watch_gc()
    b.watch_gc()
    a.watch_gc()  # once per clock
    assert len(ours()) == before + 2
    with a.phase("prepare_step"):
        pass
    gc.collect()  # a full collection: generation 2
    with a.phase("collect"):
        pass
    names = [c[0] for c in a.timeline()]
    assert names == ["prepare_step", "gc2", "collect"], names
    assert [c[0] for c in b.timeline()] == ["gc2"]
    stats = a.stats()
    assert stats["gc2_calls_total"] == 1 and stats["gc2_wall_ms_total"] > 0
    assert {"gc0_calls_total", "gc1_calls_total"} <= set(stats)
    del a, b
    gc.collect()
    assert len(ours()) <= before and len(ours(live=False)) >= len(ours()) + 2
    HostClock().watch_gc()  # drops every dead one; its own is dead at once too
    HostClock().watch_gc()
    assert len(ours(live=False)) == len(ours()) + 1  # the last one's: the next drops it
