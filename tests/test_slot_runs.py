"""A row family's entries that set only their sites and position bitmaps are staged as
the columns they set (engine/slots.py stage_runs): a request's sites and the bitmap
words from each entry's first set bit to its last, not its whole row, which a long
max_model_len makes hundreds of KiB (every entry's bitmap is max_model_len / 32 words).
Whatever requests come and go, with other families staging whole rows of the same
slots, the device block equals the host mirror after every staged write, and a
released slot is inactive again."""
import numpy as np
import pytest
import torch
from helpers import engine_tables
from hypothesis import given, settings
from hypothesis import strategies as st

from graphtap.engine import slots as slots_module
from graphtap.engine.families.capture import CaptureFamily
from graphtap.engine.families.pattern import PatternFamily
from graphtap.ops.backend import TORCH
from graphtap.spec import CaptureEntry, NormalisedSpec, PatternEntry
from graphtap.spec.entries import Span
from graphtap.spec.sites import SiteTable, expand_patterns

SITES = SiteTable(expand_patterns(["blocks.*.hook_resid_post",
                                   "blocks.*.attn.hook_pattern"], 2))
RULES = st.one_of(st.sampled_from(["all", "prompt", "generated", "last_prompt"]),
                  st.builds(lambda a, n: Span(a, a + n), st.integers(0, 900),
                            st.integers(1, 90)))


@pytest.fixture(autouse=True)
def runs_whatever_the_row(monkeypatch):
    monkeypatch.setattr(slots_module, "RUNS_FROM_BYTES", 0)


def families(max_len: int):
    """Tables and the capture and pattern families of max_len, staging by runs whatever
    their row's size (RUNS_FROM_BYTES: 0)."""
    et = engine_tables(max_reqs=4, max_len=max_len, num_sites=len(SITES), max_captures=3,
                       num_heads=4, patterns=True)
    common = dict(backend=TORCH, sites=SITES, max_len=max_len, model_dtype=torch.bfloat16)
    capture = CaptureFamily(et.ops.capture, et.capture, et.slots,
                            widths={"resid_post": (64, 0)}, **common)
    pattern = PatternFamily(et.ops.pattern, et.pattern, et.slots, key_caches={}, **common)
    return et, capture, pattern


def hs(rule="last_prompt", layers=(0, 1)) -> NormalisedSpec:
    return NormalisedSpec(capture=tuple(
        CaptureEntry(layer, "resid_post", f"blocks.{layer}.hook_resid_post", "model", None,
                     rule) for layer in layers))


def test_an_hs_admission_at_a_long_context_stages_its_set_words_not_its_row():
    """At max_model_len 131072 (4096 bitmap words an entry) an hs request (2 sites at
    the last prompt token) stages 2 sites and 2 words, and its removal the same; the
    whole row is never staged (it was, before: every admission and removal)."""
    et, capture, _ = families(131072)
    block = et.slots
    inactive = block.host[1].copy()
    capture.add_request(1, "r1", 300, hs())
    assert not block._dirty
    runs = np.concatenate(block._runs[1])
    assert (runs[:, 1] - runs[:, 0]).sum() == 4
    block.apply()
    assert np.array_equal(block.gpu.numpy(), block.host)
    capture.remove_request("r1")
    assert not block._dirty and (np.concatenate(block._runs[1]) == runs).all()
    block.apply()
    assert np.array_equal(block.host[1], inactive)
    assert np.array_equal(block.gpu.numpy(), block.host)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["capture", "pattern",
                                                                    "remove", "apply"]),
                              st.lists(RULES, min_size=1, max_size=3), st.integers(1, 999)),
                    max_size=25))
def test_the_device_block_follows_the_host_whatever_comes_and_goes(ops):
    """Captures (staged by runs), patterns (their heads: whole rows) in the same slots,
    removals, re-admissions of a slot without a removal, in any order: after every
    staged write the device block is the host's; a slot every family released is
    inactive on both."""
    et, capture, pattern = families(1000)
    block = et.slots
    inactive = block.host[0].copy()
    held: dict[int, str] = {}
    for n, (slot, op, rules, prompt_len) in enumerate(ops):
        if op == "apply":
            block.apply()
            assert np.array_equal(block.gpu.numpy(), block.host)
            continue
        if op == "remove":
            if slot in held:
                for f in (capture, pattern):
                    f.remove_request(held[slot])
                del held[slot]
            continue
        req = f"r{n}"
        if slot in held:  # the slot's last request leaves first, as in vLLM
            gone = held.pop(slot)
            for f in (capture, pattern):
                f.remove_request(gone)
        spec = hs(rules[0], layers=tuple(range(min(2, len(rules))))) if op == "capture" \
            else NormalisedSpec(pattern=tuple(
                PatternEntry(i % 2, f"blocks.{i % 2}.attn.hook_pattern", "model", (0, 2), r)
                for i, r in enumerate(rules[:2])), capture=hs(rules[-1], (1,)).capture)
        for f in (capture, pattern):
            f.add_request(slot, req, prompt_len, spec)
        held[slot] = req
    for slot, req in held.items():
        for f in (capture, pattern):
            f.remove_request(req)
    block.apply()
    assert np.array_equal(block.gpu.numpy(), block.host)
    assert all(np.array_equal(block.host[s], inactive) for s in range(4))


def test_more_elements_than_the_ring_holds_go_as_whole_rows(monkeypatch):
    """A step whose runs outnumber the element ring's capacity writes those slots'
    rows whole instead, and the device block is still the host's."""
    monkeypatch.setattr(slots_module, "ELEMENTS", 8)
    et, capture, _ = families(4096)  # 128 words an entry
    block = et.slots
    for slot in range(4):
        capture.add_request(slot, f"r{slot}", 4000, hs("all"))
    assert not block._dirty
    block.apply()
    assert np.array_equal(block.gpu.numpy(), block.host)
    assert block.elements.capacity < sum(
        int((r[:, 1] - r[:, 0]).sum()) for r in capture._runs.values())


@pytest.mark.parametrize("max_len", [280, 131072])
def test_a_slot_claimed_dirty_is_reset_whole(max_len):
    """A slot re-admitted without its last request's removal (its columns not known
    inactive) is reset and written whole, as before the runs."""
    et, capture, _ = families(max_len)
    block = et.slots
    capture.add_request(2, "a", 50, hs("prompt"))
    capture._slot_of.pop("a")  # vLLM removed it unseen: the slot is reused as it is
    capture.add_request(2, "b", 20, hs())
    assert 2 in block._dirty
    block.apply()
    assert np.array_equal(block.gpu.numpy(), block.host)


def test_small_rows_are_staged_whole(monkeypatch):
    """Below RUNS_FROM_BYTES a request's row is staged whole, as before the runs."""
    monkeypatch.setattr(slots_module, "RUNS_FROM_BYTES", 1 << 30)
    et, capture, _ = families(280)
    capture.add_request(1, "r1", 100, hs())
    assert et.slots._dirty == {1} and not et.slots._runs
    et.slots.apply()
    assert np.array_equal(et.slots.gpu.numpy(), et.slots.host)


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.booleans(),
                              st.lists(RULES, min_size=1, max_size=3), st.integers(1, 999)),
                    max_size=20))
def test_runs_leave_the_block_as_whole_rows_do(ops):
    """The same admissions and removals staged by runs and staged whole leave the same
    device block (the whole-row path is the one the engine tests check against HF)."""
    blocks = []
    for threshold in (0, 1 << 30):
        slots_module.RUNS_FROM_BYTES = threshold
        et, capture, _ = families(1000)
        held: dict[int, str] = {}
        for n, (slot, remove, rules, prompt_len) in enumerate(ops):
            if slot in held:
                capture.remove_request(held.pop(slot))
            if not remove:
                capture.add_request(slot, f"r{n}", prompt_len,
                                    hs(rules[0], layers=tuple(range(min(2, len(rules))))))
                held[slot] = f"r{n}"
            if n % 3 == 2:
                et.slots.apply()
        et.slots.apply()
        blocks.append(et.slots.gpu.numpy().copy())
    assert np.array_equal(*blocks)
