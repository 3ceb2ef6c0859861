"""`graphtap demo guard` on SmolLM2 (one engine): the Attention Tracker guard with heads
given on the command line (the six the full demo's calibration picks), threshold from
the calibration prompts, stops the injected held-out reviews and lets the benign through;
engine sites are the heads' layers only."""
from graphtap.guard_demo import parse_heads

HEADS = ["9:3", "15:2,5", "16:7", "22:1", "24:2"]


def test_demo_guard_with_given_heads(tmp_path):
    from graphtap.demo import run_guard_demo

    png, report = tmp_path / "guard.png", {}
    heads = parse_heads(HEADS)
    assert run_guard_demo("smollm2", heads, png=str(png), report=report) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["heads"] == heads and 0.3 < report["threshold"] < 0.7
    assert report["caught"] >= 5 and report["passed"] >= 5, report
