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
