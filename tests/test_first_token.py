"""benchmarks/gpu/first_token.py: request 0's first-token window laid over the hook
manager's phase calls, paired against the base mode by repetition."""
import pytest

from benchmarks.gpu.first_token import first_token_window, window


def run(mode, rep, first_ms, calls, rate="burst64"):
    """A burst run whose request 0 was scheduled at t = 10 s and had its first token
    first_ms later; calls: (phase, start ms after t, wall ms)."""
    return {"rate": rate, "mode": mode, "rep": rep,
            "ttft_marks_by_request": [[10.0, 10.0 + first_ms / 1e3], [10.0, 11.0]],
            "host_timeline": [[name, 10.0 + at / 1e3, ms] for name, at, ms in calls]}


def test_phases_count_only_inside_the_window_and_nested_ones_once():
    w = window(run("hs", 0, 40.0, [
        ("add_request", -1.0, 2.0),  # half before the window
        ("prepare_step", 5.0, 1.0), ("prepare_plan", 5.1, 0.5),  # nested: not again
        ("per_request", 30.0, 3.0),  # the output thread
        ("collect", 39.0, 4.0),  # runs past the first token
        ("collect", 50.0, 1.0)]))  # after it
    assert w["add_request"] == pytest.approx(1.0) and w["prepare_step"] == pytest.approx(1.0)
    assert w["collect"] == pytest.approx(1.0) and w["per_request"] == pytest.approx(3.0)
    assert w["main"] == pytest.approx(3.0) and w["window"] == pytest.approx(40.0)
    assert "prepare_plan" not in w


def test_paired_against_the_base_by_repetition():
    runs = [run("idle", 0, 40.0, [("add_request", 1.0, 1.0)]),
            run("hs", 0, 43.0, [("add_request", 1.0, 2.0), ("per_request", 20.0, 0.5)]),
            run("idle", 1, 50.0, [("add_request", 1.0, 1.0)]),
            run("hs", 1, 53.0, [("add_request", 1.0, 2.0), ("per_request", 20.0, 0.5)]),
            run("hs", 2, 99.0, []),  # no idle run of that repetition: not paired
            {"rate": 4.0, "mode": "hs", "rep": 0}]  # not a burst
    got = first_token_window(runs)["burst64"]
    assert got["idle"]["reps"] == 2 and "paired_ms" not in got["idle"]
    hs = got["hs"]
    assert hs["reps"] == 3 and hs["paired_ms"]["window"] == pytest.approx(3.0)
    assert hs["paired_ms"]["main"] == pytest.approx(1.0)
    assert hs["outside_ms"] == pytest.approx(1.5)  # 3 ms later, 1.5 of it graphtap's


def test_runs_without_a_timeline_are_left_out():
    assert first_token_window([{"rate": "burst64", "mode": "idle", "rep": 0,
                                "ttft_marks_by_request": [[1.0, 2.0]]}]) == {}
