#!/usr/bin/env python3
"""Whether a profiled run's device-to-host copies overlap its kernels: from a gzipped
Chrome trace of profile_capture.py (--trace), per stream the kernels' and the copies'
busy time, the share of the DtoH copies' time during which some kernel ran, and the time
the device ran copies alone (no kernel anywhere). A sink whose copies run alone makes
the step wait for the link (its rows/s then follow the copy, not the model).

    python -m benchmarks.gpu.trace_overlap OUT/trace-qwen2-1.5b-sink-1.json.gz
"""
from __future__ import annotations

import argparse
import gzip
import json

import numpy as np


def _union(iv: np.ndarray) -> np.ndarray:
    """Sorted, merged [start, end) intervals."""
    if not len(iv):
        return iv.reshape(0, 2)
    iv = iv[np.argsort(iv[:, 0])]
    out = [list(iv[0])]
    for s, e in iv[1:]:
        if s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return np.array(out)


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Total length of the intersection of two merged interval sets."""
    total, j = 0.0, 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            total += min(e, b[k][1]) - max(s, b[k][0])
            k += 1
    return total


def analyse(events: list[dict]) -> dict:
    kernels, copies, by_stream = [], [], {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy"):
            continue
        iv = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        stream = (e.get("args") or {}).get("stream", e.get("tid"))
        s = by_stream.setdefault(str(stream), {"kernel_ms": 0.0, "dtoh_ms": 0.0,
                                               "other_copy_ms": 0.0, "dtoh_gb": 0.0})
        if e["cat"] == "kernel":
            kernels.append(iv)
            s["kernel_ms"] += (iv[1] - iv[0]) / 1000
        elif "DtoH" in e.get("name", ""):
            copies.append(iv)
            s["dtoh_ms"] += (iv[1] - iv[0]) / 1000
            s["dtoh_gb"] += float((e.get("args") or {}).get("bytes", 0)) / 1e9
        else:
            s["other_copy_ms"] += (iv[1] - iv[0]) / 1000
    k, c = _union(np.array(kernels, float)), _union(np.array(copies, float))
    copy_ms = float((c[:, 1] - c[:, 0]).sum()) / 1000 if len(c) else 0.0
    both = _overlap(c, k) / 1000 if len(c) and len(k) else 0.0
    ends = [iv[-1][1] for iv in (k, c) if len(iv)]
    starts = [iv[0][0] for iv in (k, c) if len(iv)]
    span = float(max(ends) - min(starts)) / 1000 if ends else 0.0
    return {"span_ms": round(span, 2),
            "kernel_busy_ms": round(float((k[:, 1] - k[:, 0]).sum()) / 1000, 2) if len(k) else 0.0,
            "dtoh_busy_ms": round(copy_ms, 2),
            "dtoh_with_kernels_pct": round(float(both) / copy_ms * 100, 1) if copy_ms else None,
            "dtoh_alone_ms": round(float(copy_ms - both), 2),
            "streams": {s: {k2: round(v, 3) for k2, v in d.items()}
                        for s, d in by_stream.items()}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    args = ap.parse_args()
    with gzip.open(args.trace, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    print(json.dumps(analyse(events), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
