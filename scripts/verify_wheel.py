#!/usr/bin/env python3
"""Verify a graphtap-patched vLLM wheel against the pinned stock wheel and patches/series.

Exits non-zero, naming the first problem class found, unless:
  * RECORD lists every member exactly once and every sha256 and size matches;
  * re-applying the series to the stock wheel reproduces the patched files byte for byte;
  * no other file differs from stock (binaries included; METADATA may differ only in Version);
  * the version is 0.29.0+graphtap.<series hash> of the series in this checkout.
"""
import argparse
import sys
import zipfile
from pathlib import Path

import wheelkit as wk


def check_record(zw: zipfile.ZipFile, di: str) -> tuple[list[str], dict[str, tuple[str, str]], dict[str, str]]:
    """RECORD against the members; also returns each member's actual hash, so the
    comparison with stock never trusts RECORD."""
    problems, actual = [], {}
    record = wk.parse_record(zw.read(f"{di}/RECORD").decode())
    members = [n for n in zw.namelist() if not n.endswith("/")]
    if len(members) != len(set(members)):
        problems.append("the zip holds duplicate member names")
    for name in members:
        if name == f"{di}/RECORD":
            continue
        data = zw.read(name)
        actual[name] = wk.record_hash(data)
        if name not in record:
            problems.append(f"RECORD does not list {name}")
            continue
        digest, size = record[name]
        if digest != actual[name] or size != str(len(data)):
            problems.append(f"RECORD hash or size wrong for {name}")
    for name in record:
        if name not in zw.NameToInfo:
            problems.append(f"RECORD lists {name}, which is not in the wheel")
    if f"{di}/RECORD" not in record:
        problems.append("RECORD does not list itself")
    return problems, record, actual


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel", type=Path)
    args = ap.parse_args()
    patches = wk.read_series()
    want_version = wk.local_version(patches)
    problems: list[str] = []
    with zipfile.ZipFile(args.wheel) as zw:
        di = wk.dist_info_dir(zw)
        version = di[: -len(".dist-info")].rsplit("-", 1)[1]
        meta_version = next((ln.split(": ", 1)[1] for ln in zw.read(f"{di}/METADATA").decode().splitlines()
                             if ln.startswith("Version: ")), None)
        if version != want_version or meta_version != want_version:
            problems.append(f"version is {version} (METADATA {meta_version}); the series in this "
                            f"checkout gives {want_version}")
        rec_problems, record, actual = check_record(zw, di)
        problems += rec_problems
        stock_path = wk.stock_wheel(wk.flavor_of(args.wheel))
        changes = wk.apply_series(stock_path, patches)
        with zipfile.ZipFile(stock_path) as zs:
            sdi = wk.dist_info_dir(zs)
            stock_record = wk.parse_record(zs.read(f"{sdi}/RECORD").decode())
            for name, (digest, _) in stock_record.items():
                if name.startswith(sdi + "/"):
                    continue
                if name in changes:
                    continue
                if name not in actual:
                    problems.append(f"stock file {name} is missing, and the series does not delete it")
                elif actual[name] != digest:
                    problems.append(f"{name} differs from stock, and the series does not touch it")
            for name, data in changes.items():
                if data is None:
                    if name in actual:
                        problems.append(f"{name} should be deleted by the series")
                elif name not in zw.NameToInfo or zw.read(name) != data:
                    problems.append(f"{name} is not what the series makes of the stock file")
            for name in actual:
                if not name.startswith(di + "/") and name not in stock_record and name not in changes:
                    problems.append(f"{name} is in neither the stock wheel nor the series")
            for info in zs.infolist():
                if info.filename.startswith(sdi + "/") and not info.filename.endswith("/RECORD"):
                    rel = info.filename[len(sdi) + 1:]
                    stock_data = zs.read(info)
                    if rel == "METADATA":
                        stock_data = wk.set_metadata_version(stock_data, want_version)
                    if f"{di}/{rel}" not in zw.NameToInfo or zw.read(f"{di}/{rel}") != stock_data:
                        problems.append(f"{di}/{rel} differs from stock beyond the version")
    if problems:
        print(f"FAIL {args.wheel.name}: {len(problems)} problem(s)", file=sys.stderr)
        for p in problems[:50]:
            print(f"  - {p}", file=sys.stderr)
        return 1
    print(f"OK {args.wheel.name}: RECORD complete ({len(record)} entries), series reproduces "
          f"{len(changes)} file(s), all other files equal stock, version {want_version}")
    return 0


if __name__ == "__main__":
    wk.main_guard(main)
