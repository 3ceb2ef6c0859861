"""`graphtap demo` on SmolLM2 (one engine): the report prints, the PNG is written, and
the Attention Tracker guard, calibrated on one set of reviews, stops the injected ones of
another and lets the benign ones through."""
from pathlib import Path


def test_demo_on_smollm2(tmp_path):
    from graphtap.demo import run_demo

    png, report = tmp_path / "scores.png", {}
    assert run_demo("smollm2", eager=True, png=str(png), report=report) == 0
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["caught"] >= 5 and report["passed"] >= 5, report
    finishes = [finish for _, finish, _ in report["results"]]
    assert set(finishes) <= {"guard", "length", "stop"}
    assert Path(png).stat().st_size > 5000
