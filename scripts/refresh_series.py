#!/usr/bin/env python3
"""Refresh the patch series the quilt way, with git as the stack.

  refresh_series.py checkout DIR [--flavor cpu|cuda]
      DIR becomes a git repository: the stock wheel's sources as commit 'stock', then one
      commit per patch in series order (its message is the patch's DEP-3 header).
      Edit, then amend or rebase those commits, or add new ones (the message is the header).

  refresh_series.py export DIR
      Rewrites patches/NNNN-<slug>.patch and patches/series from the commits after 'stock':
      header = commit message, body = the commit's diff with 3 lines of context.

Headers are DEP-3: Description (a first line of at most 80 characters, the why in its
continuation lines), Author, Origin, Forwarded, Last-Update, plus our Applies-to; export
refuses a header that lacks any, and a series of more than 8 patches.
"""
import argparse
import re
from pathlib import Path

import wheelkit as wk

def checkout(directory: Path, flavor: str) -> int:
    if directory.exists() and any(directory.iterdir()):
        raise wk.BuildError(f"{directory} exists and is not empty")
    directory.mkdir(parents=True, exist_ok=True)
    wk.init_source_repo(wk.stock_wheel(flavor), directory)
    for patch in wk.read_series():
        wk.apply_patch(directory, patch, commit=True)
    print(f"{directory}: stock + {len(wk.read_series())} patch commits; edit, then export")
    return 0


def slug(description: str, limit: int = 48) -> str:
    words = re.sub(r"[^a-z0-9]+", "-", description.lower()).strip("-").split("-")
    out = words[0]
    for w in words[1:]:  # whole words only, so names never end mid-word
        if len(out) + 1 + len(w) > limit:
            break
        out += "-" + w
    return out


def export(directory: Path) -> int:
    shas = wk._git(directory, "rev-list", "--reverse", "stock..HEAD").split()
    if len(shas) > wk.MAX_PATCHES:
        raise wk.BuildError(f"{len(shas)} patch commits: the series holds at most "
                            f"{wk.MAX_PATCHES} (fold fixes into the patch they fix)")
    for old in wk.PATCHES.glob("[0-9][0-9][0-9][0-9]-*.patch"):
        old.unlink()
    names = []
    for n, sha in enumerate(shas, start=1):
        header = wk._git(directory, "log", "-1", "--format=%B", sha).strip()
        problems = wk.dep3_problems(header)
        if problems:
            raise wk.BuildError(f"commit {sha[:10]}'s DEP-3 header: {'; '.join(problems)}:"
                                f"\n{header}")
        fields = wk.dep3_fields(header)
        diff = wk._git(directory, "diff", "--no-color", "--no-renames", "--full-index",
                       "-U3", f"{sha}^", sha)
        name = f"{n:04d}-{slug(fields['Description'].split(chr(10))[0])}.patch"
        (wk.PATCHES / name).write_text(f"{header}\n---\n{diff}\n")
        names.append(name)
    (wk.PATCHES / "series").write_text("".join(f"{n}\n" for n in names))
    print(f"exported {len(names)} patches; new series hash {wk.series_hash(wk.read_series())[:8]}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("checkout")
    c.add_argument("dir", type=Path)
    c.add_argument("--flavor", choices=sorted(wk.PINS["flavors"]), default="cpu")
    e = sub.add_parser("export")
    e.add_argument("dir", type=Path)
    args = ap.parse_args()
    return checkout(args.dir, args.flavor) if args.cmd == "checkout" else export(args.dir)


if __name__ == "__main__":
    wk.main_guard(main)
