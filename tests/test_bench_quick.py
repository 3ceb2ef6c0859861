"""The GPU TPOT benchmark's CPU `--quick` mode, so the script never rots (no speed claims)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPS = ROOT / "overlay" / "graphtap" / "ops"


def bench(module: str, *args, env=None, timeout=900):
    """`python -m benchmarks.gpu.<module> ARGS` from the repository root."""
    return subprocess.run([sys.executable, "-m", f"benchmarks.gpu.{module}", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.parametrize("variant", ["stock", "graphtap"])
def test_bench_tpot_quick(variant, tmp_path, llama_path):
    modes = (["--modes", "idle,steer,hs,qk,mixed", "--burst-modes", "dump",
              "--trace-modes", "idle,hs"] if variant == "graphtap" else [])
    res = bench("bench_tpot", "--quick", "--variant", variant, "--out", tmp_path, *modes)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / f"tpot-tiny-{variant}-quick.json").read_text())
    modes = {r["mode"] for r in data["runs"]}
    assert modes == ({"plain"} if variant == "stock" else
                     {"idle", "steer", "hs", "qk", "mixed", "dump"})
    assert all(r["tpot_ms_median"] > 0 for r in data["runs"])
    # Rows per request (16 in, 8 out: 23 positions run; 4 layers, hs at 1, 2, 3): hs 3;
    # qk 4 q rows + 4 x 16 k rows; dump 3 x 23. Counted from what came back.
    per_request = {"plain": 0, "idle": 0, "steer": 0, "hs": 3, "qk": 68, "mixed": 71, "dump": 69}
    for r in data["runs"]:
        assert r["capture_failed"] == 0
        assert r["rows"] == per_request[r["mode"]] * r["requests"], r
        assert r["rows_per_request_min"] == r["rows_per_request_max"] == per_request[r["mode"]]
    assert {r["rate"] for r in data["runs"]} == {8.0, "burst3"}
    assert all(r["rate"] == "burst3" for r in data["runs"] if r["mode"] == "dump")
    assert all(len(r["tpot_ms_by_request"]) == r["requests"] for r in data["runs"])
    # request 0's first-token window over the hook manager's phases (first_token.py)
    bursts = [r for r in data["runs"] if r["rate"] == "burst3"]
    assert all(len(m) == 2 and m[0] <= m[1] for r in bursts for m in r["ttft_marks_by_request"])
    if variant == "graphtap":
        from benchmarks.gpu.first_token import TOP

        # the hook manager's phases, and the process's collections (HostClock.watch_gc)
        assert all(r["host_timeline"] and {c[0] for c in r["host_timeline"]} <=
                   set(TOP) | {"prepare_plan", "prepare_route_tokens", "prepare_route_rows",
                               "gc0", "gc1", "gc2"}
                   for r in bursts)
        window = data["summary_first_token_ms"]["burst3"]
        assert set(window) == {r["mode"] for r in bursts}
        assert window["hs"]["ms"]["window"] > 0 and "outside_ms" in window["hs"]
        assert window["hs"]["ms"]["main"] > 0  # its admission and step ran in the window
        # the frontend's phases (first_token.frontend_timeline): a capturing request's
        # finish, once each
        capturing = {"hs", "qk", "mixed", "dump"}
        assert all(sum(c[0] == "finish" for c in r["frontend_timeline"]) ==
                   (r["requests"] if r["mode"] in capturing else 0) for r in bursts)
    if variant == "graphtap":  # one traced burst per mode, not counted with the runs
        traces = {p.parent.name for p in (tmp_path / "traces").rglob("*.trace.json.gz")}
        assert traces == {"burst-idle", "burst-hs"}, traces
    # the engine core's clock: every request's figure, and of the same scale as the client's
    for r in data["runs"]:
        assert len(r["tpot_engine_ms_by_request"]) == r["requests"]
        assert all(e is not None and 0 < e for e in r["tpot_engine_ms_by_request"]), r
        assert 0.2 < r["tpot_engine_ms_median"] / r["tpot_ms_median"] < 5, r
    assert all(r["frontend_gc_ms"] >= 0 and r["frontend_gc_full"] >= 0 for r in data["runs"])
    if variant == "graphtap":
        overhead = data["summary_overhead_vs_idle_pct"]
        assert set(overhead) == {"steer", "hs", "qk", "mixed", "dump"}
        assert set(overhead["dump"]) == {"burst3"} and set(overhead["hs"]) == {"8", "burst3"}
        from benchmarks.gpu.capture_report import merged, render, table

        md = table([tmp_path / "tpot-tiny-graphtap-quick.json"])
        assert "| idle TPOT |" in md and "| hs |" in md and "| dump | – |" in md, md
        assert set(data["summary_overhead_vs_idle_pct_engine"]) == set(overhead)
        md = render(*merged([tmp_path / "tpot-tiny-graphtap-quick.json"]), engine=True)
        assert "| hs |" in md and "| dump | – |" in md, md


def test_paired_overheads():
    """Per-request ratios vs idle in the same repetition, per rep and pooled."""
    from benchmarks.gpu.tpot_stats import paired_overheads

    runs = [{"mode": "idle", "rate": 8.0, "rep": 0, "tpot_ms_by_request": [5.0, 10.0, None]},
            {"mode": "hs", "rate": 8.0, "rep": 0, "tpot_ms_by_request": [5.1, 10.2, 7.0]},
            {"mode": "idle", "rate": 8.0, "rep": 1, "tpot_ms_by_request": [4.0, 8.0, 6.0]},
            {"mode": "hs", "rate": 8.0, "rep": 1, "tpot_ms_by_request": [4.0, 8.0, 6.06]},
            {"mode": "hs", "rate": "burst3", "rep": 0, "tpot_ms_by_request": [1.0]}]
    assert paired_overheads(runs) == {"hs": {"8": {"reps": [2.0, 0.0], "pooled": 1.0}}}
    # the engine clock's figures pair the same way, under their own key
    engine = [{**{k: v for k, v in r.items() if k != "tpot_ms_by_request"},
               "tpot_engine_ms_by_request": r["tpot_ms_by_request"]} for r in runs]
    assert paired_overheads(engine, "tpot_engine_ms_by_request") == \
        {"hs": {"8": {"reps": [2.0, 0.0], "pooled": 1.0}}}
    assert paired_overheads(engine) == {}
    # ci: the pooled figure's bootstrap interval over whole repetitions, reproducible
    cell = paired_overheads(runs, ci=True)["hs"]["8"]
    assert cell["ci95"][0] <= cell["pooled"] <= cell["ci95"][1] and cell["ci95"][1] <= 2.0
    assert cell == paired_overheads(runs, ci=True)["hs"]["8"]


def test_ttft_by_position():
    """Burst TTFTs: a mode's added latency paired by admission position, and what each
    admitted request adds (the slope), per load; Poisson runs are left out."""
    from benchmarks.gpu.tpot_stats import ttft_by_position

    runs = [{"mode": "idle", "rate": "burst4", "rep": r, "ttft_ms_by_request":
             [10.0 + 3 * i + r for i in range(4)]} for r in range(3)]
    runs += [{"mode": "qk", "rate": "burst4", "rep": r, "ttft_ms_by_request":
              [50.0 + 3.5 * i + r for i in range(4)]} for r in range(3)]
    runs += [{"mode": "qk", "rate": 8.0, "rep": 0, "ttft_ms_by_request": [1.0, 2.0]},
             {"mode": "qk", "rate": "burst2", "rep": 0, "ttft_ms_by_request": [1.0, None]}]
    out = ttft_by_position(runs)
    assert set(out) == {"burst4", "burst2"}
    qk, idle = out["burst4"]["qk"], out["burst4"]["idle"]
    assert qk["reps"] == 3 and qk["median_ms"] == 56.25 and idle["paired_ms"] == 0.0
    assert qk["paired_ms"] == 40.75  # 40 + 0.5 i over i = 0..3, median of 12
    assert abs(qk["slope_ms"] - 3.5) < 1e-9 and abs(idle["slope_ms"] - 3.0) < 1e-9
    # no idle burst of that size, and a request without a token: no pairs, no slope
    assert out["burst2"]["qk"]["paired_ms"] is None and out["burst2"]["qk"]["slope_ms"] is None
    assert qk["phases_ms"] is None  # runs from before the phases were recorded
    runs[3]["ttft_phases_ms_by_request"] = [None, {"admit": 1.0, "queue": 2.0, "prefill": 30.0,
                                                   "deliver": 4.0}] * 2
    assert ttft_by_position(runs)["burst4"]["qk"]["phases_ms"] == {
        "admit": 1.0, "queue": 2.0, "prefill": 30.0, "deliver": 4.0}
    assert ttft_by_position(runs)["burst4"]["qk"]["phases_paired_ms"] is None  # idle has none
    # paired by position in the same repetition: request i's phase minus idle's request i's
    runs[0]["ttft_phases_ms_by_request"] = [{"admit": 0.5, "queue": 2.0, "prefill": 20.0,
                                             "deliver": 1.0}] * 4
    assert ttft_by_position(runs)["burst4"]["qk"]["phases_paired_ms"] == {
        "admit": 0.5, "queue": 0.0, "prefill": 10.0, "deliver": 3.0}


def test_ttft_phases_split_ttft_on_one_clock():
    """A request's TTFT in phases from the engine core's event timestamps (monotonic) and
    the client's own start and first-token times; no events (stats off): None."""
    from types import SimpleNamespace

    from benchmarks.gpu.tpot_stats import ttft_phases

    m = SimpleNamespace(queued_ts=10.002, scheduled_ts=10.010, first_token_ts=10.050)
    out = SimpleNamespace(metrics=m)
    assert ttft_phases(out, 10.0, 10.0515) == {"admit": 2.0, "queue": 8.0, "prefill": 40.0,
                                               "deliver": 1.5}
    assert ttft_phases(SimpleNamespace(metrics=None), 10.0, 10.1) is None
    assert ttft_phases(SimpleNamespace(metrics=SimpleNamespace(queued_ts=0.0)), 1, 2) is None


def test_host_phases_are_what_each_run_added():
    """The hook manager's host time per mode: each run's share of the workers'
    cumulative counters, the first run (the engine's start) left out."""
    from benchmarks.gpu.tpot_stats import host_phases

    cumulative = [("warm", 100.0, 10), ("idle", 150.0, 12), ("idle", None, None),
                  ("hs", 160.0, 15), ("idle", 214.0, 18), ("hs", 222.0, 22),
                  ("hs", 235.0, 23)]
    runs = [{"mode": m} if ms is None else  # a run without counters (a stock engine)
            {"mode": m, "hook_counters": {"host.add_request_wall_ms_total": ms,
                                          "host.add_request_calls_total": c,
                                          "ring.steps_total": 5}}
            for m, ms, c in cumulative]
    out = host_phases(runs)
    assert out["idle"] == {"add_request_calls": 2.5, "add_request_ms": 52.0}
    assert out["hs"] == {"add_request_calls": 3.0, "add_request_ms": 10.0}
    assert "warm" not in out


def test_bootstrap_ci_resamples_repetitions():
    """One repetition gives no interval; repetitions that disagree give a wide one."""
    from benchmarks.gpu.tpot_stats import bootstrap_ci

    assert bootstrap_ci([[1.01, 1.02, 1.03]]) == [2.0, 2.0]
    lo, hi = bootstrap_ci([[1.0] * 50, [1.10] * 50, [1.0] * 50, [1.10] * 50])
    assert lo == 0.0 and hi == 10.0  # resampling the 200 requests alone: about +5 % only


def test_report_merges_results(tmp_path):
    for variant, modes in (("stock", {"plain": 5.0}), ("graphtap", {"idle": 5.01, "steer": 5.05})):
        (tmp_path / f"tpot-llama3-8b-{variant}.json").write_text(json.dumps({
            "model": "llama3-8b", "variant": variant, "input_len": 256, "output_len": 128,
            "gpu": "H200", "summary_tpot_ms": {m: {"1": v} for m, v in modes.items()}}))
    res = bench("bench_tpot", "--report", "--out", tmp_path)
    assert res.returncode == 0, res.stderr
    md = (tmp_path / "tpot.md").read_text()
    assert "graphtap steer" in md and "+1.00 %" in md and "+0.20 %" in md


def test_capture_report_verdict_says_when_the_noise_hides_a_target():
    from benchmarks.gpu.capture_report import verdict

    cell = lambda pooled: {"reps": [pooled], "pooled": pooled}  # noqa: E731
    met = {"hs": {"8": cell(0.4), "burst64": cell(2.4)}, "qk": {"16": cell(3.6)}}
    out = verdict(met)
    assert "hs: worst +2.4 % at burst64 vs ≤ 2.5 %: met" in out
    assert "qk: worst +3.6 % at 16 vs ≤ 3.5 %: not met" in out and "A/A" not in out
    noisy = verdict({**met, "idle2": {"8": cell(-4.0), "16": cell(1.0)}})
    assert "hs: worst +2.4 % at burst64 vs ≤ 2.5 %: met (A/A noise 4.0 % > target" in noisy
    assert "worst |pooled| 4.0 %" in noisy


def test_profile_traces_keep_each_mode(tmp_path):
    """One trace per profiled mode: a model name with a dot ("qwen2-1.5b") once made
    every mode's trace overwrite the same file."""
    from benchmarks.gpu.profile_capture import write_trace

    class Prof:
        def __init__(self, mode):
            self.mode = mode

        def export_chrome_trace(self, path):
            Path(path).write_text(json.dumps({"mode": self.mode}))

    names = [write_trace(Prof(m), tmp_path / f"trace-qwen2-1.5b-{m}-{i}")
             for i, m in enumerate(["idle", "qk"])]
    assert names == ["trace-qwen2-1.5b-idle-0.json.gz", "trace-qwen2-1.5b-qk-1.json.gz"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names


def test_trace_overlap_measures_copies_beside_kernels():
    """trace_overlap.py: a DtoH copy half under a kernel of another stream counts half as
    overlapped; kernels of two streams at once count once; other copies and host events
    are left out."""
    from benchmarks.gpu.trace_overlap import analyse

    def x(cat, name, ts, dur, stream, nbytes=0):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                "args": {"stream": stream, "bytes": nbytes}}

    events = [x("kernel", "k1", 0, 1000, 7), x("kernel", "k2", 500, 1000, 9),
              x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 1000, 1000, 21, 2e9),
              x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 3000, 500, 7),
              x("cpu_op", "aten::copy_", 0, 9000, 1)]
    got = analyse(events)
    assert got["kernel_busy_ms"] == 1.5 and got["dtoh_busy_ms"] == 1.0
    assert got["dtoh_with_kernels_pct"] == 50.0 and got["dtoh_alone_ms"] == 0.5
    assert got["span_ms"] == 2.0
    assert got["streams"]["21"]["dtoh_gb"] == 2.0
    assert got["streams"]["7"]["other_copy_ms"] == 0.5
    json.dumps(got)  # plain numbers: it goes into the result files


def test_profile_capture_cpu(tmp_path):
    """profile_capture.py's CPU run (tiny model): rows come back, graphtap's ranges are
    seen every step, the added work is computed against idle, one trace per mode asked."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # --cpu sets it
    res = bench("profile_capture", "--cpu", "--requests", "2", "--modes",
                "idle,hs,qk,focus,idle", "--trace", "idle,qk", "--cprofile",
                env={**env, "OUT": str(tmp_path)}, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    modes = json.loads((tmp_path / "profile-capture.json").read_text())["modes"]
    assert [m["mode"] for m in modes] == ["idle", "hs", "qk", "focus", "idle"]
    # 2 requests x 16 prompt tokens: hs 3 rows each; qk 4 q rows + 4 x 16 k rows each;
    # focus (its pattern sites configured for it): the last prompt token's mass, 4 entries
    assert [m["rows"] for m in modes] == [0, 6, 136, 8, 0]
    assert not any(m["errors"] for m in modes)
    for m in modes:
        assert m["steps"] == 8 and m["step_ms"] > 0
        assert set(m["graphtap_host_ms_per_step"]) >= {"graphtap.prepare_step",
                                                       "graphtap.collect"}
        assert "graphtap_added_pct_of_idle_step" in m
        top = m["python_top"]
        assert m["gc_ms"] >= 0 and len(top["own"]) == 60
        # graphtap's own functions by cumulative time: the hook manager's step among them
        assert any(f.startswith("manager.py:") and f.endswith("(prepare_step)")
                   for f, *_ in top["graphtap_cumulative"])
        kinds = m["step_kinds"]  # 8 steps: 7 intervals; hs and qk copy rows home in some
        assert sum(kinds[k]["count"] for k in ("plain", "copy")) <= 7
        assert (kinds["copy"]["count"] > 0) == (m["mode"] != "idle"), kinds
        assert all(calls > 0 and cum >= own >= 0 for rows in top.values()
                   for _, calls, own, cum in rows)
    assert sorted(p.name for p in tmp_path.glob("trace-*.json.gz")) == [  # not hs's
        "trace-tiny-idle-0.json.gz", "trace-tiny-idle-4.json.gz", "trace-tiny-qk-2.json.gz"]


def test_added_work_is_over_the_idle_runs():
    from benchmarks.gpu.profile_capture import added_work

    mode = lambda name, host, dev, step: {  # noqa: E731
        "mode": name, "graphtap_host_ms_per_step": {"graphtap.prepare_step": host},
        "graphtap_device_ms_per_step": dev, "step_ms": step}
    modes = [mode("idle", 0.05, 0.0, 4.0), mode("qk", 0.2, 0.01, 4.4),
             mode("idle", 0.07, 0.0, 4.0)]
    added_work(modes)
    assert modes[1]["graphtap_added_ms_per_step"] == 0.15
    assert modes[1]["graphtap_added_pct_of_idle_step"] == 3.75
    assert modes[0]["graphtap_added_ms_per_step"] == -0.01


def test_device_gaps_merge_overlaps_and_count_waits():
    """profile_capture.device_gaps: overlapping device activities are one busy span; the
    host events are left out; gaps over 0.1 ms are listed largest first, with where."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks.gpu.profile_capture import device_gaps

    def ev(start, end, device=DeviceType.CUDA):
        return SimpleNamespace(device_type=device,
                               time_range=SimpleNamespace(start=start, end=end))
    prof = SimpleNamespace(events=lambda: [
        ev(0, 100), ev(50, 300), ev(320, 400), ev(900, 1000), ev(0, 5000, DeviceType.CPU),
        ev(1100, 1100)])  # an empty one: ignored
    got = device_gaps(prof)
    assert got["span_ms"] == 1.0 and got["busy_ms"] == 0.48 and got["idle_ms"] == 0.52
    assert got["gaps_over_100us"] == 1 and got["gaps_over_100us_ms"] == 0.5
    assert got["largest_gaps_ms_at_ms"] == [(0.5, 0.4)]
    assert device_gaps(SimpleNamespace(events=lambda: [ev(0, 9, DeviceType.CPU)])) == {}


def test_bench_twin_quick(tmp_path):
    """bench_twin.py on CPU: two engines, each mode beside an idle run with the same
    arrivals, rows complete, paired per `pair` on both clocks; dump at the burst only
    (no speed claims)."""
    res = bench("bench_twin", "--quick", "--burst-modes", "dump", "--out", tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / "twin-tiny-quick.json").read_text())
    runs = data["runs"]
    # (mode, idle) x (modes idle2, hs, qk x loads 8 req/s, 3 at once + dump at 3 at once)
    assert len(runs) == 2 * (3 * 2 + 1)
    for mode_run, idle_run in zip(runs[::2], runs[1::2]):
        assert idle_run["mode"] == "idle" and idle_run["pair"] == mode_run["mode"]
        assert {mode_run["engine"], idle_run["engine"]} == {0, 1}
        assert {mode_run["first"], idle_run["first"]} == {True, False}
        assert (mode_run["rate"], mode_run["rep"]) == (idle_run["rate"], idle_run["rep"])
        rows = {"idle2": 0, "hs": 3, "qk": 68, "dump": 3 * (16 + 8 - 1)}[mode_run["mode"]]
        assert mode_run["rows_per_request_min"] == mode_run["rows_per_request_max"] == rows
        assert idle_run["rows"] == 0 and mode_run["capture_failed"] == 0
    for key in ("summary_overhead_vs_idle_pct", "summary_overhead_vs_idle_pct_engine"):
        assert set(data[key]) == {"idle2", "hs", "qk", "dump"}
        assert all(set(c) == ({"burst3"} if m == "dump" else {"8", "burst3"})
                   for m, c in data[key].items())


def test_twin_runs_pair_with_the_idle_run_beside_them():
    from benchmarks.gpu.tpot_stats import paired_overheads

    run = lambda mode, pair, t: {"mode": mode, "pair": pair, "rate": 4.0, "rep": 0,  # noqa: E731
                                 "tpot_ms_by_request": t}
    runs = [run("hs", "hs", [2.0, 4.0]), run("idle", "hs", [2.0, 4.0]),
            run("qk", "qk", [3.3, 6.6]), run("idle", "qk", [3.0, 6.0])]
    assert paired_overheads(runs) == {"hs": {"4": {"reps": [0.0], "pooled": 0.0}},
                                      "qk": {"4": {"reps": [10.0], "pooled": 10.0}}}


def test_profile_counts_every_graphtap_kernel():
    """profile_capture.py finds graphtap's device time by kernel name: every kernel
    defined in ops/*_triton.py must be in its list, or its time would go uncounted."""
    import re

    from benchmarks.gpu.profile_capture import GRAPHTAP_KERNELS

    defined = {name for f in OPS.glob("*_triton.py")
               for name in re.findall(r"^def (_\w+_kernel)\(", f.read_text(), re.M)}
    assert defined and defined == set(GRAPHTAP_KERNELS)


def test_results_readme_is_generated_from_the_result_files():
    """benchmarks/results/README.md is what `python -m benchmarks.results_readme` writes
    from the files manifest.json lists, and every listed file exists."""
    import json

    results = ROOT / "benchmarks" / "results"
    manifest = json.loads((results / "manifest.json").read_text())
    listed = {f for g in manifest["groups"] for f in g["files"]}
    assert all((results / f).exists() for f in listed)
    kept = {p.name for p in results.glob("*.json")} - {"manifest.json"}
    assert kept == listed, kept ^ listed  # superseded files leave the tree
    res = subprocess.run([sys.executable, "-m", "benchmarks.results_readme", "--check"],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_serve_bench_quick(tmp_path):
    """vllm bench serve against a stock and a graphtap server (CPU, tiny model): every
    run completes every request and the table is written (no speed claims)."""
    res = subprocess.run([sys.executable, "-m", "benchmarks.serve_bench", "--quick",
                          "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=1200, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / "serve-bench-tiny-quick.json").read_text())
    assert [r["mode"] for r in data["runs"]] == ["stock", "idle", "steer", "hs", "qk", "idle2"]
    assert all(r["completed"] == r["num_prompts"] == 4 and r["failed"] == 0 for r in data["runs"])
    assert all(r["median_tpot_ms"] > 0 for r in data["runs"])
    md = (tmp_path / "serve-bench-tiny-quick.md").read_text()
    assert "| steer | 4/4 |" in md and "| stock | 4/4 |" in md, md


def test_first_step_host_runs_on_the_cpu(tmp_path):
    """benchmarks/gpu/first_step_host.py (issue 18's first hooked step, piece by piece)
    runs its pieces on the CPU: the steps route what hs and qk ask (3 and 1028 rows)."""
    env = {**os.environ, "OUT": str(tmp_path)}
    res = bench("first_step_host", "--samples", 1, "--label", "before", env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / "first-step-host.json").read_text())
    out = {r["workload"]: r for r in data["overlays"]["before"]}
    assert {k: r["rows_routed"] for k, r in out.items()} == {"hs": 3, "qk": 1028}
    assert all(v > 0 for r in out.values() for v in r["warm_us"].values())
    # a second overlay's run adds its column (results_readme renders both); another
    # sample count is another measurement and does not mix with the file's
    assert bench("first_step_host", "--samples", 1, "--label", "after",
                 env=env).returncode == 0
    data = json.loads((tmp_path / "first-step-host.json").read_text())
    assert (data["device"], data["samples"], list(data["overlays"])) == \
        ("cpu", 1, ["before", "after"])
    res = bench("first_step_host", "--samples", 2, env=env)
    assert res.returncode != 0 and "with 1 samples" in res.stdout + res.stderr
