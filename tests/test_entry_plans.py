"""A row family's admission (engine/rows.py): what a request's entries make whatever the
request (site ids, output formats, position rules) is remembered per distinct entries
(EntryPlan), so a burst of requests with one spec admits each from the plan. The tables
and the step plan must be exactly what the family writes without it."""
import numpy as np
import torch
from helpers import engine_tables
from hypothesis import given, settings
from hypothesis import strategies as st

from graphtap.engine import rows
from graphtap.engine.families.capture import CaptureFamily
from graphtap.engine.families.pattern import PatternFamily
from graphtap.engine.wanted import Wants, rows_in_step
from graphtap.ops.backend import TORCH
from graphtap.spec import CaptureEntry, NormalisedSpec, PatternEntry
from graphtap.spec.entries import Span
from graphtap.spec.sites import SiteTable, expand_patterns

L, HEADS = 100, 4
SITES = SiteTable(expand_patterns(["blocks.*.hook_resid_post", "blocks.*.attn.hook_q",
                                   "blocks.*.attn.hook_pattern"], 2))
RULES = st.one_of(st.sampled_from(["all", "prompt", "generated", "last_prompt"]),
                  st.builds(lambda a, n: Span(a, a + n), st.integers(0, 80), st.integers(1, 30)),
                  st.lists(st.integers(0, L - 1), min_size=1, max_size=6, unique=True)
                  .map(lambda p: tuple(sorted(p))))
HEAD_SETS = st.lists(st.integers(0, HEADS - 1), min_size=1, max_size=HEADS, unique=True) \
    .map(lambda h: tuple(sorted(h)))
CAPTURE = st.builds(
    lambda layer, kind, dtype, heads, rule: CaptureEntry(
        layer, kind, f"blocks.{layer}." + ("hook_resid_post" if kind == "resid_post"
                                           else "attn.hook_q"),
        dtype, heads if kind == "attn_q" else None, rule),
    st.integers(0, 1), st.sampled_from(["resid_post", "attn_q"]),
    st.sampled_from(["model", "float32"]), HEAD_SETS, RULES)
PATTERN = st.builds(lambda layer, dtype, heads, rule: PatternEntry(
    layer, f"blocks.{layer}.attn.hook_pattern", dtype, heads, rule),
    st.integers(0, 1), st.sampled_from(["model", "float32"]), HEAD_SETS, RULES)


def families(remember: bool):
    et = engine_tables(max_reqs=4, max_len=L, num_sites=len(SITES), max_captures=3,
                       num_heads=HEADS, patterns=True)
    common = dict(backend=TORCH, sites=SITES, max_len=L, model_dtype=torch.bfloat16)
    capture = CaptureFamily(et.ops.capture, et.capture, et.slots,
                            widths={"resid_post": (64, 0), "attn_q": (64, 16)}, **common)
    pattern = PatternFamily(et.ops.pattern, et.pattern, et.slots, key_caches={}, **common)
    for f in (capture, pattern):
        f.remember_plans = remember
    return et, (capture, pattern)


def clone(entries: tuple) -> tuple:
    """The same entries as new objects (each request's spec comes off the wire anew)."""
    return tuple(type(e)(*(tuple(v) if isinstance(v, tuple) else v
                           for v in (getattr(e, f) for f in e.__struct_fields__)))
                 for e in entries)


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(st.tuples(st.lists(CAPTURE, max_size=3, unique_by=lambda e: e.name),
                                 st.lists(PATTERN, max_size=2, unique_by=lambda e: e.name)),
                      min_size=1, max_size=3),
       admissions=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2),
                                     st.integers(1, L - 1), st.booleans()), max_size=12))
def test_remembered_plans_write_what_the_entries_do(specs, admissions):
    """Requests come and go on a few slots with a few specs (entries made anew per
    request): with plans remembered the host tables, the formats and the step bound
    equal a family's that makes every request's plan from its entries."""
    (a_tables, a), (b_tables, b) = families(True), families(False)
    live = {}  # req_id -> (its spec, prompt length)
    for n, (slot, which, prompt_len, leave) in enumerate(admissions):
        captures, patterns = specs[min(which, len(specs) - 1)]
        spec = NormalisedSpec(capture=clone(tuple(captures)), pattern=clone(tuple(patterns)))
        for fams in (a, b):
            for f in fams:
                f.add_request(slot, f"s{slot}", prompt_len, spec)
                if leave:
                    f.remove_request(f"s{slot}")
        live.pop(f"s{slot}", None)
        if not leave:
            live[f"s{slot}"] = (spec, prompt_len)
        np.testing.assert_array_equal(a_tables.slots.host, b_tables.slots.host)
        assert a_tables.slots._dirty == b_tables.slots._dirty
        for fa, fb in zip(a, b):
            assert fa._formats == fb._formats
            batch = _batch(fa, n)
            assert fa.plan(batch) == fb.plan(batch) == _bound(fa, batch, live)
    assert all(len(f._plans) <= len(specs) for f in a) and not any(f._plans for f in b)


def _batch(family, n: int):
    """Every live request of the family in one step, at a position drawn from n."""
    from types import SimpleNamespace

    live = sorted(family._slot_of.items(), key=lambda kv: kv[1])
    slots = np.array([s for _, s in live], np.int64)
    return SimpleNamespace(req_ids=[r for r, _ in live], idx_mapping_np=slots,
                           num_computed_tokens_np=(slots * 7 + n) % L,
                           num_scheduled_tokens=np.full(len(live), 1 + n % 5),
                           num_draft_tokens_per_req=None)


def _bound(family, batch, live) -> int:
    """The step's bound from each live request's entries one by one (what a wanted
    token of each entry yields, added up), not from the family's plans."""
    wants = {}
    for req_id in family._slot_of:
        spec, prompt_len = live[req_id]
        w = wants[req_id] = Wants(L)
        for e in family.entries(spec):
            w.add(e.positions, prompt_len, family.describe(e, torch.float32)[1])
    return sum(n for _, _, n in rows_in_step(wants, batch))


def test_one_spec_in_every_request_makes_one_plan_and_the_plans_stay_bounded(monkeypatch):
    """A burst with one spec (its entries made anew per request) admits from one plan;
    distinct entries past PLANS push the oldest plan out."""
    monkeypatch.setattr(rows, "PLANS", 3)
    _, (capture, _) = families(True)
    entry = CaptureEntry(1, "resid_post", "blocks.1.hook_resid_post", "model", None,
                         "last_prompt")
    for i in range(4):
        capture.add_request(i, f"r{i}", 10 + i, NormalisedSpec(capture=clone((entry,))))
    assert len(capture._plans) == 1
    for i in range(5):
        capture.add_request(0, "x", 10, NormalisedSpec(capture=(
            CaptureEntry(1, "resid_post", "blocks.1.hook_resid_post", "model", None,
                         Span(i, i + 2)),)))
    assert len(capture._plans) == 3
    assert (entry,) not in capture._plans


def test_requests_of_one_prompt_length_share_their_wants_and_the_lengths_stay_bounded(
        monkeypatch):
    """A plan's Wants and position bitmaps are made once per prompt length (a burst's
    requests share them) and at most SHAPES lengths are kept: lengths coming back after
    being pushed out write what a family without remembered plans writes."""
    monkeypatch.setattr(rows, "SHAPES", 2)
    (a_tables, (a, _)), (b_tables, (b, _)) = families(True), families(False)
    entries = (CaptureEntry(1, "resid_post", "blocks.1.hook_resid_post", "model", None,
                            "last_prompt"),
               CaptureEntry(0, "attn_q", "blocks.0.attn.hook_q", "model", (1,), Span(3, 40)))
    for n, prompt_len in enumerate([5, 9, 5, 13, 5, 9, 33, 9]):
        slot = n % 4
        for f in (a, b):
            f.add_request(slot, f"r{slot}", prompt_len, NormalisedSpec(capture=clone(entries)))
        np.testing.assert_array_equal(a_tables.slots.host, b_tables.slots.host)
        assert a.plan(_batch(a, n)) == b.plan(_batch(b, n))
        assert a._table._plain == b._table._plain
        assert len(capture_plan(a).shaped) <= 2
    a.add_request(1, "r1", 9, NormalisedSpec(capture=clone(entries)))
    a.add_request(2, "r2", 9, NormalisedSpec(capture=clone(entries)))
    assert a._wanted["r1"] is a._wanted["r2"]  # one length: one Wants (read-only)
    assert set(capture_plan(a).shaped) == {33, 9}


def test_a_plans_bitmaps_stay_within_their_bytes(monkeypatch):
    """Each prompt length keeps one block of bitmaps, a row per entry (one slice write a
    request); with a long max_model_len they are large, so a plan keeps at most
    SHAPES_BYTES of them, and what it writes matches a family that keeps none."""
    (a_tables, (a, _)), (b_tables, (b, _)) = families(True), families(False)
    entries = (CaptureEntry(1, "resid_post", "blocks.1.hook_resid_post", "model", None,
                            "last_prompt"),
               CaptureEntry(0, "attn_q", "blocks.0.attn.hook_q", "model", (1,), Span(3, 40)))
    a.add_request(0, "r0", 5, NormalisedSpec(capture=clone(entries)))
    ((wanted, block, _),) = capture_plan(a).shaped.values()
    assert block.shape == (2, a._pos.shape[2])
    monkeypatch.setattr(rows, "SHAPES_BYTES", 2 * block.nbytes)
    for n, prompt_len in enumerate([9, 13, 5, 33]):
        for f in (a, b):
            f.add_request(n % 4, f"r{n % 4}", prompt_len, NormalisedSpec(capture=clone(entries)))
        np.testing.assert_array_equal(a_tables.slots.host, b_tables.slots.host)
        assert len(capture_plan(a).shaped) <= 2
    assert set(capture_plan(a).shaped) == {5, 33}


def capture_plan(family) -> rows.EntryPlan:
    (plan,) = family._plans.values()
    return plan
