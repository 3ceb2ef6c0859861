"""benchmarks/gpu/trace_summary.py on a synthetic torch-profiler trace: kernels summed by
name, graphtap's kernels told apart, and the window's device-busy time and idle gaps
(overlapping kernels counted once)."""
import gzip
import json

import pytest

from benchmarks.gpu.trace_summary import busy_and_gaps, gaps_by_host, gaps_by_step, summarise


def test_busy_time_counts_overlaps_once_and_lists_gaps():
    kernels = [(0, 100), (50, 100), (400, 100), (2000, 50)]  # us
    busy, gaps = busy_and_gaps(kernels, 0, 1000, min_gap_us=100)
    assert busy == 250  # 0-150 and 400-500; the kernel at 2000 is past the window
    assert gaps == [(150, 250)]  # 150 -> 400


def test_summary_of_a_trace(tmp_path, capsys):
    events = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 1000, "dur": 300},
              {"ph": "X", "cat": "kernel", "name": "_capture_kernel", "ts": 1400,
               "dur": 20},
              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 3000, "dur": 300},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaHostAlloc", "ts": 1500,
               "dur": 1200},
              {"ph": "X", "cat": "user_annotation", "name": "graphtap.to_cpu", "ts": 1450,
               "dur": 1300}]
    path = tmp_path / "t.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summarise(str(path), window_ms=5, top=5, min_gap_us=100)
    out = capsys.readouterr().out
    assert "3 kernels" in out and "0.600 ms      2x  gemm" in out
    assert "graphtap-like kernels: 0.020 ms (1 launches)" in out
    assert "device busy 0.62 ms" in out and "0.42:1580" in out  # 1420 -> 3000
    assert "cudaHostAlloc 1x 1.20 ms" in out and "graphtap.to_cpu 1.30" in out


def test_ops_inside_graphtaps_ranges(tmp_path, capsys):
    """--ops-in: the torch ops and runtime calls that ran inside each graphtap range of
    the window, on the range's thread (the same thread's calls outside it, and another
    thread's inside its span, are not counted)."""
    range_ = {"ph": "X", "cat": "user_annotation", "name": "graphtap.collect", "ts": 1000,
              "dur": 500, "tid": 1}
    events = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 900, "dur": 300}, range_,
              {"ph": "X", "cat": "cpu_op", "name": "aten::clone", "ts": 1100, "dur": 40,
               "tid": 1},
              {"ph": "X", "cat": "cpu_op", "name": "aten::clone", "ts": 1200, "dur": 60,
               "tid": 1},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 1300,
               "dur": 10, "tid": 1},
              {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1300, "dur": 10,
               "tid": 2},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "ts": 1600, "dur": 10,
               "tid": 1}]
    path = tmp_path / "t.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summarise(str(path), window_ms=5, top=5, min_gap_us=100, ops_in="graphtap.")
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("   inside")][0]
    assert "inside graphtap.collect: 1 calls, 0.500 ms" in line
    assert "aten::clone 2x 0.100" in line and "cudaMemcpyAsync 1x 0.010" in line
    assert "aten::add" not in line and "aten::mul" not in line


def test_device_gaps_laid_over_the_busy_loop():
    """--gaps-from: each stretch of device idle time goes to the busy loop's innermost
    graphtap range there, else its outermost torch op, else its innermost other range
    (vLLM's step), else "(python)"; another thread's ops and time the device is busy
    count for nothing."""
    def x(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}
    ev = [x("kernel", "gemm", 0, 100, 7), x("gpu_memcpy", "Memcpy HtoD", 300, 100, 7),
          x("kernel", "gemm", 1000, 100, 7),
          x("user_annotation", "graphtap.prepare_step", 100, 150),
          x("cpu_op", "aten::copy_", 250, 100),  # 300-350 under the copy: not idle
          x("cpu_op", "aten::empty", 260, 10),  # inside copy_: copy_ is what is named
          x("user_annotation", "graphtap.collect", 400, 200),
          x("cpu_op", "aten::index", 400, 100),  # inside collect: the range is named
          x("cpu_op", "aten::add", 700, 100, tid=2)]
    where = gaps_by_host(ev, 0, 2000, top=5)
    assert where == pytest.approx({"graphtap.prepare_step": 150, "aten::copy_": 50,
                                   "graphtap.collect": 200, "(python)": 1300}, abs=0.01)
    # per vLLM step range on the busy loop: up to the next one's start, then the window's
    steps = gaps_by_step(ev + [x("user_annotation", "execute_context_1(256)", 0, 390),
                               x("user_annotation", "execute_context_8(2047)", 390, 900)],
                         0, 1100, top=5)
    assert [s["idle_us_by_host"] for s in steps] == [
        {"graphtap.prepare_step": 150, "aten::copy_": 50},
        {"graphtap.collect": 200, "execute_context_8(2047)": 400}]
    assert [(s["span_ms"], s["device_idle_ms"], s["graphtap_ms"]) for s in steps] == [
        (0.39, 0.2, 0.15), (0.71, 0.6, 0.2)]
