"""The benchmarks' mode orders (benchmarks/gpu/workloads.mode_order): every repetition
runs each mode once, and over a cycle of repetitions every mode runs right after every
other mode equally often. The rotations used before always put the same mode before a
given one (idle2, the A/A control, always right after idle)."""
from collections import Counter

import pytest

from benchmarks.gpu.workloads import mode_order


@pytest.mark.parametrize("n", range(2, 9))
def test_every_mode_follows_every_other_equally_often(n):
    modes = [f"m{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    follows = Counter()
    for rep in range(cycle):
        order = mode_order(modes, rep)
        assert sorted(order) == modes, order
        follows.update(zip(order, order[1:]))
    assert len(follows) == n * (n - 1)  # every ordered pair of different modes
    assert set(follows.values()) == {(n - 1) * cycle // (n * (n - 1))}


def test_the_ttft_loads_modes():
    modes = ["idle", "idle2", "steer", "hs", "qk", "focus"]
    before = Counter()
    for rep in range(12):
        order = mode_order(modes, rep)
        before.update(a for a, b in zip(order, order[1:]) if b == "idle2")
    assert before == {m: 2 for m in modes if m != "idle2"}
