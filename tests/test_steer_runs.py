"""Steering requests at a long max_model_len stage the columns they set (engine/slots.py
stage_runs), not their slot's whole row: at 131072 a row holds every family's entries'
bitmaps, 448 KiB here, of which a steering entry sets its site, vector, coefficients,
gate, condition and the bitmap words its positions fill. Whatever comes and goes, with
captures by runs and whole rows in the same slots, the device block equals the host
mirror after every staged write; a released slot is clean and inactive; a gate the op
set on the device is cleared when the slot is claimed again; and runs leave the block
as whole rows do."""
import numpy as np
import pytest
import torch
from helpers import engine_tables
from hypothesis import given, settings
from hypothesis import strategies as st

from graphtap.engine import slots as slots_module
from graphtap.engine.families.capture import CaptureFamily
from graphtap.engine.families.steer import SteerFamily
from graphtap.engine.families.vectors import VectorBank
from graphtap.ops.backend import TORCH
from graphtap.spec import CaptureEntry, ModelShape, NormalisedSpec, normalise, parse_spec
from graphtap.spec.sites import SiteTable, expand_patterns

H = 8
SITES = ["blocks.1.hook_resid_post", "blocks.2.hook_resid_post"]


def families(max_len: int):
    et = engine_tables(max_reqs=4, max_len=max_len, num_sites=2, max_captures=2,
                       max_steers=2, max_vectors=8, hidden=H, steer_width=H, patterns=False)
    sites = SiteTable(expand_patterns(["blocks.*.hook_resid_post"], 3))
    steer = SteerFamily(et, sites, VectorBank(et.ops.steer))
    capture = CaptureFamily(et.ops.capture, et.capture, et.slots, widths={
        "resid_post": (H, 0)}, backend=TORCH, sites=sites, max_len=max_len,
        model_dtype=torch.float32)
    shape = ModelShape(num_layers=3, hidden_size=H, max_model_len=max_len, max_steers=2,
                       max_vectors=8, configured_sites=set(SITES) | {"blocks.0.hook_resid_post"})
    return et, steer, capture, shape


def steering(shape, positions, seed: int = 0, condition: bool = False) -> NormalisedSpec:
    vec = np.random.default_rng(seed).normal(size=H).round(3).tolist()
    entry = {"site": SITES[1], "op": "add", "vector": vec, "positions": positions}
    if condition:
        entry["condition"] = {"site": SITES[0], "vector": [1.0] * H, "threshold": 0.5}
    return normalise(parse_spec({"steer": [entry]}), shape)


def hs(rule="last_prompt") -> NormalisedSpec:
    return NormalisedSpec(capture=(CaptureEntry(1, "resid_post", SITES[0], "model", None,
                                                rule),))


def apply(et, steer) -> None:
    steer.apply_staged_writes()
    et.slots.apply()
    assert np.array_equal(et.slots.gpu.numpy(), et.slots.host)


def test_a_steering_admission_at_a_long_context_stages_its_columns_not_its_row():
    et, steer, _, shape = families(131072)
    block = et.slots
    assert block.stages_runs()
    inactive = block.host[2].copy()
    steer.add_request(2, "s", 100, steering(shape, "last_prompt"))
    assert not block._dirty and list(block._runs) == [2]
    staged = sum(int((r[:, 1] - r[:, 0]).sum()) for r in block._runs[2])
    assert staged < 20  # site, vector, 4 coefficients, gate, one bitmap word
    apply(et, steer)
    steer.remove_request("s")
    assert not block._dirty and np.array_equal(block.host[2], inactive)
    apply(et, steer)
    assert block.group(et.steer.all).clean[2] == 1


def test_a_gate_the_op_set_is_cleared_when_the_slot_is_claimed_again():
    et, steer, _, shape = families(131072)
    steer.add_request(1, "a", 50, steering(shape, "generated", condition=True))
    apply(et, steer)
    gate = et.slots.view(et.steer.gate)
    gate[1, 0] = 1  # the op decided the gate open
    steer.remove_request("a")
    steer.add_request(1, "b", 50, steering(shape, "generated", seed=1, condition=True))
    apply(et, steer)
    assert int(gate[1, 0]) == 0


OPS = st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["steer", "hs", "none", "cond"]),
                         st.sampled_from(["all", "prompt", "generated", "last_prompt"]),
                         st.integers(1, 900)), max_size=24)


def run(ops, max_len: int, threshold: int) -> np.ndarray:
    """The ops (admit into a slot, freeing it first) staged with runs from `threshold`
    bytes of row on; the device block after each apply equals the host's."""
    slots_module_threshold = slots_module.RUNS_FROM_BYTES
    slots_module.RUNS_FROM_BYTES = threshold
    try:
        et, steer, capture, shape = families(max_len)
        held: dict[int, str] = {}
        for n, (slot, kind, rule, prompt_len) in enumerate(ops):
            if slot in held:
                rid = held.pop(slot)
                steer.remove_request(rid)
                capture.remove_request(rid)
            rid = f"r{n}"
            spec = hs(rule) if kind == "hs" else NormalisedSpec() if kind == "none" else \
                steering(shape, "generated" if kind == "cond" else rule, seed=n,
                         condition=kind == "cond")  # a gated steer acts on generated
            steer.add_request(slot, rid, prompt_len, spec)
            capture.add_request(slot, rid, prompt_len, spec)
            held[slot] = rid
            if n % 2:
                apply(et, steer)
        apply(et, steer)
        return et.slots.gpu.numpy().copy()
    finally:
        slots_module.RUNS_FROM_BYTES = slots_module_threshold


@settings(max_examples=30, deadline=None)
@given(ops=OPS)
def test_runs_and_whole_rows_leave_the_same_block(ops):
    assert np.array_equal(run(ops, 1000, 0), run(ops, 1000, 1 << 30))


@pytest.mark.parametrize("elements", [8, 40])
def test_slots_past_the_element_ring_go_whole_the_rest_by_runs(monkeypatch, elements):
    """Steering at every position (a whole bitmap of runs): the slots whose runs the
    element ring holds go by runs, the rest as whole rows, and the block is the host's."""
    monkeypatch.setattr(slots_module, "ELEMENTS", elements)
    monkeypatch.setattr(slots_module, "RUNS_FROM_BYTES", 0)
    et, steer, _, shape = families(1000)  # 32 words an entry
    for slot in range(4):
        steer.add_request(slot, f"r{slot}", 100, steering(shape, "all", seed=slot))
    apply(et, steer)
