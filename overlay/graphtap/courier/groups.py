"""A step's labels in groups: one key per (slot, site) pair, and whether the device's own
order already groups them (the split then needs no sort)."""
from __future__ import annotations

import numpy as np

from graphtap.courier.pack import run_starts


def group_keys(slot: np.ndarray, site: np.ndarray) -> np.ndarray:
    """One int64 per (slot, site) pair (slots and sites stay far below the factor)."""
    return slot.astype(np.int64) * 1_000_003 + site


def grouped_in_order(labels: np.ndarray, order: tuple[int, ...]) -> bool:
    """Whether each (order[0], order[1]) group of the rows is one contiguous run, sorted
    by the remaining columns of `order` inside it: the usual step, whose rows the device
    writes site-major with each request's tokens adjacent and in position order. Checked
    in a few O(n) passes instead of sorting (lexsort of a qk prefill step's 8k labels
    was a quarter of its split here)."""
    if len(labels) < 2:
        return True
    a, b, *rest = (labels[:, k] for k in order)
    same = (a[1:] == a[:-1]) & (b[1:] == b[:-1])
    # inside a group, the remaining columns must be non-decreasing lexicographically
    if len(rest) == 1:  # captures: positions (one pass, on every step's critical path)
        ordered = rest[0][1:] >= rest[0][:-1]
    else:
        ordered = np.ones(len(labels) - 1, dtype=bool)  # equal so far
        greater = np.zeros(len(labels) - 1, dtype=bool)
        for c in rest:
            greater |= ordered & (c[1:] > c[:-1])
            ordered &= c[1:] == c[:-1]
        ordered |= greater
    if not np.all(~same | ordered):
        return False
    starts = run_starts(~same)
    keys = group_keys(a[starts], b[starts])
    return len(np.unique(keys)) == len(keys)  # no group split over two runs
