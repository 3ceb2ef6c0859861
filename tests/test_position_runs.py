"""Position rules as runs (spec/positions.py) against the mask over every position they
replace at admission: the same positions, bitmap words, counts and row bounds, for every
rule kind, at any prompt and model length."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from graphtap.engine.wanted import Wants
from graphtap.spec.entries import Span
from graphtap.spec.positions import (mask_bitmap, position_mask, position_runs, runs_bitmap,
                                     rule_count, rule_keys, runs_count,
                                     runs_keys)


@st.composite
def rules(draw):
    max_len = draw(st.integers(1, 300))
    prompt_len = draw(st.integers(0, max_len))
    kind = draw(st.sampled_from(["all", "prompt", "generated", "last_prompt", "span",
                                 "dict", "list", "many"]))
    if kind == "span" or kind == "dict":
        start = draw(st.integers(0, max_len - 1))
        end = draw(st.integers(start, max_len))
        rule = Span(start, end) if kind == "span" else {"start": start, "end": end}
    elif kind == "list":
        rule = tuple(sorted(set(draw(st.lists(st.integers(0, max_len - 1), max_size=30)))))
    elif kind == "many":  # more runs than runs_bitmap draws one by one
        rule = tuple(range(0, max_len, 2))
    else:
        rule = kind
    return rule, prompt_len, max_len


@settings(max_examples=400, deadline=None)
@given(rules(), st.data())
def test_runs_hold_the_masks_positions(case, data):
    rule, prompt_len, max_len = case
    mask = position_mask(rule, prompt_len, max_len)
    runs = position_runs(rule, prompt_len, max_len)
    starts, ends = runs
    assert starts.dtype == ends.dtype == np.int64
    assert (starts < ends).all() and (ends[:-1] < starts[1:]).all()  # disjoint, apart
    got = np.zeros(max_len, dtype=bool)
    for s, e in zip(starts, ends):
        got[s:e] = True
    np.testing.assert_array_equal(got, mask)
    words = data.draw(st.integers((max_len + 31) // 32, (max_len + 31) // 32 + 2))
    np.testing.assert_array_equal(runs_bitmap(runs, words), mask_bitmap(mask, words))
    lo = data.draw(st.integers(0, max_len))
    hi = data.draw(st.integers(lo, max_len + 5))
    assert runs_count(runs, lo, hi) == int(np.count_nonzero(mask[lo:hi]))
    assert runs_keys(runs, hi) == int((np.flatnonzero(mask[:hi]) + 1).sum())
    assert rule_count(rule, prompt_len, max_len, lo, hi) == runs_count(runs, lo, hi)
    assert rule_keys(rule, prompt_len, max_len, hi) == runs_keys(runs, hi)


@settings(max_examples=200, deadline=None)
@given(rules(), st.integers(0, 310), st.integers(0, 310), st.integers(1, 40))
def test_wants_bound_as_with_masks(case, lo, span, tokens):
    rule, prompt_len, max_len = case
    w = Wants(max_len)
    w.add(rule, prompt_len, 3)
    mask = position_mask(rule, prompt_len, max_len)
    wanted = np.flatnonzero(mask)
    assert w.end == (int(wanted[-1]) + 1 if wanted.size else 0)
    hi = lo + span
    expect = 0 if lo >= w.end else 3 * min(tokens, int(np.count_nonzero(mask[lo:hi])))
    assert w.rows_in(lo, hi, tokens) == expect


def test_bitmap_edges_within_and_across_words():
    def bits(s, e, words=3):
        w = runs_bitmap((np.array([s]), np.array([e])), words).view(np.uint32)
        return [p for p in range(32 * words) if (int(w[p // 32]) >> (p % 32)) & 1]
    assert bits(0, 32) == list(range(32))
    assert bits(31, 33) == [31, 32]
    assert bits(5, 6) == [5]
    assert bits(3, 96) == list(range(3, 96))
    assert bits(64, 96) == list(range(64, 96))
