"""benchmarks/gpu/trace_summary.py on a synthetic torch-profiler trace: kernels summed by
name, graphtap's kernels told apart, and the window's device-busy time and idle gaps
(overlapping kernels counted once)."""
import gzip
import json

from benchmarks.gpu.trace_summary import busy_and_gaps, summarise


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
