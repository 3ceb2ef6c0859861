"""Position rules as host arrays: runs [start, end) of positions, the bitmap words the
graph ops read (bit j of word w is position 32*w + j), and the bool mask over positions.

Admission works on runs: a rule is one run, or a few (explicit positions), whatever the
model's length, where a mask over max_model_len made each capture entry's admission
grow with it (benchmarks/cpu: test_admission_by_max_len).
"""
from __future__ import annotations

import numpy as np

from graphtap.spec.entries import Span


def position_mask(rule, prompt_len: int, max_len: int, size: int | None = None) -> np.ndarray:
    """A position rule as a bool array over positions 0..size-1 (default max_len)."""
    mask = np.zeros(size or max_len, dtype=bool)
    if rule == "all":
        mask[:max_len] = True
    elif rule == "prompt":
        mask[:prompt_len] = True
    elif rule == "generated":
        mask[prompt_len:max_len] = True
    elif rule == "last_prompt":
        mask[max(prompt_len - 1, 0)] = True
    elif isinstance(rule, Span):
        mask[rule.start:rule.end] = True
    elif isinstance(rule, dict):
        mask[rule["start"]:rule["end"]] = True
    else:
        mask[np.asarray(rule, dtype=np.int64)] = True
    return mask


def _bounds(rule, prompt_len: int, max_len: int) -> tuple[int, int] | None:
    """A one-run rule's [lo, hi) within [0, max_len) (possibly empty); None for explicit
    positions."""
    if isinstance(rule, str):
        if rule == "all":
            lo, hi = 0, max_len
        elif rule == "prompt":
            lo, hi = 0, prompt_len
        elif rule == "generated":
            lo, hi = prompt_len, max_len
        elif rule == "last_prompt":
            lo = max(prompt_len - 1, 0)
            hi = lo + 1
        else:
            raise ValueError(f"unknown position rule {rule!r}")
    elif isinstance(rule, Span):
        lo, hi = rule.start, rule.end
    elif isinstance(rule, dict):
        lo, hi = rule["start"], rule["end"]
    else:
        return None
    return max(lo, 0), min(hi, max_len)


def position_runs(rule, prompt_len: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """position_mask's positions as sorted, disjoint, non-empty runs: (starts, ends),
    int64, within [0, max_len)."""
    b = _bounds(rule, prompt_len, max_len)
    if b is not None:
        ok = b[0] < b[1]
        return np.array(b[:1] if ok else (), np.int64), np.array(b[1:] if ok else (), np.int64)
    at = np.unique(np.asarray(rule, dtype=np.int64))  # sorted unique (normalised already)
    if at.size and (at[0] < 0 or at[-1] >= max_len):
        raise ValueError(f"positions beyond [0, {max_len}): {at[0]}..{at[-1]}")
    breaks = np.flatnonzero(np.diff(at) != 1)
    if not at.size:
        return at, at
    return at[np.concatenate(([0], breaks + 1))], at[np.append(breaks, at.size - 1)] + 1


def rule_count(rule, prompt_len: int, max_len: int, lo: int, hi: int) -> int:
    """How many of the rule's positions lie in [lo, hi) (one-run rules in plain ints:
    numpy costs more than the arithmetic on a few values)."""
    b = _bounds(rule, prompt_len, max_len)
    if b is None:
        return runs_count(position_runs(rule, prompt_len, max_len), lo, hi)
    return max(min(b[1], hi) - max(b[0], lo), 0)


def rule_keys(rule, prompt_len: int, max_len: int, hi: int) -> int:
    """runs_keys of the rule's positions."""
    b = _bounds(rule, prompt_len, max_len)
    if b is None:
        return runs_keys(position_runs(rule, prompt_len, max_len), hi)
    e = min(b[1], hi)
    s = min(b[0], e)
    return (e * (e + 1) - s * (s + 1)) // 2


def runs_count(runs: tuple[np.ndarray, np.ndarray], lo: int, hi: int) -> int:
    """How many positions of the runs lie in [lo, hi)."""
    starts, ends = runs
    return int(np.maximum(np.minimum(ends, hi) - np.maximum(starts, lo), 0).sum())


def runs_keys(runs: tuple[np.ndarray, np.ndarray], hi: int) -> int:
    """The sum of p + 1 over the runs' positions p below hi (a pattern's row at query
    position p holds p + 1 keys): per run, a difference of triangular numbers."""
    starts, ends = runs
    ends = np.minimum(ends, hi)
    starts = np.minimum(starts, ends)
    return int(((ends * (ends + 1) - starts * (starts + 1)) // 2).sum())


def runs_bitmap(runs: tuple[np.ndarray, np.ndarray], words: int) -> np.ndarray:
    """The runs (within 32 x words positions) as bitmap words: whole words at once, the
    two edge words of each run by their bits."""
    starts, ends = runs
    if len(starts) > 64:  # many scattered positions: one pass over a mask is cheaper
        edges = np.zeros(words * 32 + 1, dtype=np.int8)  # runs are apart: no edge shared
        edges[starts], edges[ends] = 1, -1
        return mask_bitmap(np.cumsum(edges[:-1]) > 0, words)
    out = np.zeros(words, np.uint32)
    for s, e in zip(starts.tolist(), ends.tolist()):
        first, last = s >> 5, (e - 1) >> 5
        head = (0xFFFFFFFF << (s & 31)) & 0xFFFFFFFF  # bits s%32.. of the first word
        tail = 0xFFFFFFFF >> (31 - ((e - 1) & 31))  # bits ..(e-1)%32 of the last word
        if first == last:
            out[first] |= head & tail
        else:
            out[first] |= head
            out[first + 1:last] = 0xFFFFFFFF
            out[last] |= tail
    return out.view(np.int32)


def position_bitmap(rule, prompt_len: int, max_len: int, words: int) -> np.ndarray:
    return runs_bitmap(position_runs(rule, prompt_len, max_len), words)


def mask_bitmap(mask: np.ndarray, words: int) -> np.ndarray:
    """A bool mask over positions (at most 32 x words of them) as bitmap words."""
    # bytes of 8 positions, least significant bit first, read as little-endian words
    packed = np.packbits(mask, bitorder="little")
    out = np.zeros(words * 4, np.uint8)
    out[:len(packed)] = packed
    return out.view("<i4").astype(np.int32)


def bitmap_words(max_len: int) -> int:
    return (max_len + 31) // 32
