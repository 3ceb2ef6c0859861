"""Conditional steering without an engine: the gate decided by the steer op (torch
reference vs Triton kernel in Triton's interpreter), the spec's checks, the salt and the
family's slot rows."""
import numpy as np
import pytest
import torch

from graphtap.ops.steer import steer_reference
from graphtap.ops.tables import COND_BELOW, COND_SIGMOID, COND_UNIT
from graphtap.spec import ModelShape, normalise, parse_spec, steering_salt
from graphtap.spec.positions import position_bitmap
from helpers import engine_tables

H, L = 64, 100
SHAPE = ModelShape(num_layers=4, hidden_size=H, max_model_len=L, max_steers=3, max_vectors=8,
                   configured_sites={"blocks.1.hook_resid_post", "blocks.2.hook_resid_mid",
                                     "blocks.2.hook_resid_post", "blocks.1.attn.hook_z"},
                   num_heads=4, head_dim=16)
COND_SITE, STEER_SITE = 0, 1  # site ids in the op tests


def _op(backend):
    from graphtap.ops.steer_triton import steer_triton  # runs in Triton's interpreter here

    return steer_reference if backend == "torch" else steer_triton


def gated_tables(seed=0, R=4, E=3, N=24):
    """Slot s: entry 0 steers at STEER_SITE, gated by a condition at COND_SITE decided at
    position 5 (slot 3's entry 0 is unconditioned); entry 1 a plain steer at STEER_SITE;
    modes differ per slot."""
    g = torch.Generator().manual_seed(seed)
    t = engine_tables(max_reqs=R, max_tokens=N, max_steers=E, max_vectors=6, hidden=H,
                      max_len=L).ops.steer
    t.bank[1:] = torch.randn(6, H, generator=g)
    t.inv_norm[1:] = 1.0 / t.bank[1:].norm(dim=1)
    words = t.pos.shape[2]
    modes = [COND_UNIT, COND_UNIT | COND_BELOW, COND_SIGMOID, 0]
    for slot in range(R):
        for e in range(2):
            t.site[slot, e], t.vec[slot, e] = STEER_SITE, 1 + (slot + e) % 3
            t.coef[slot, e] = torch.tensor([3.0, -float("inf"), float("inf"), 0.0])
            t.pos[slot, e] = torch.from_numpy(position_bitmap("generated", 6, L, words))
        if slot < 3:
            t.cond_site[slot, 0], t.cond_vec[slot, 0] = COND_SITE, 4 + slot % 2
            t.cond_mode[slot, 0], t.cond_pos[slot, 0] = modes[slot], 5
            t.cond_coef[slot, 0] = torch.tensor([0.0, 0.0] if modes[slot] & COND_UNIT
                                                else [0.3, 0.5])
    return t


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gate_is_decided_at_its_position_and_opens_the_steer(backend):
    op = _op(backend)
    t = gated_tables()
    slot = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4])  # 4: the sentinel
    pos = torch.tensor([5, 6, 5, 6, 5, 6, 5, 6])
    g = torch.Generator().manual_seed(1)
    stream = torch.randn(8, H, generator=g)
    # slot 0: projection above 0; slot 1: the same direction, below 0
    w0, w1 = t.bank[4], t.bank[5]
    stream[0] = w0 * 0.5  # slot 0 on
    stream[2] = w1 * 0.5  # slot 1 (below): off
    stream[4] = w0 * 2.0  # slot 2: sigmoid(<h, w> + 0.3) > 0.5: on
    before = t.gate.clone()
    x = stream.clone()
    op(t, slot, x, None, pos, COND_SITE)  # the condition's site: decides, steers nothing
    assert torch.equal(x, stream)
    assert t.gate[:4, 0].tolist() == [1, 0, 1, 0]
    assert torch.equal(t.gate[:4, 1:], before[:4, 1:])
    y = stream.clone()
    op(t, slot, y, None, pos, STEER_SITE)
    ref = stream.clone()
    for r, (s, p) in enumerate(zip(slot.tolist(), pos.tolist())):
        if s == 4 or p < 6:
            continue
        for e in range(2):
            if e == 0 and s < 3 and not t.gate[s, 0]:
                continue
            ref[r] += 3.0 * t.bank[int(t.vec[s, e])]
    torch.testing.assert_close(y, ref)
    assert torch.equal(y[[0, 2, 4, 6, 7]], stream[[0, 2, 4, 6, 7]])  # prompt rows, padding


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_undecided_or_closed_gate_leaves_rows_bit_identical_whatever_the_tables_hold(backend):
    """A gated-off entry is inactive, not multiplied by zero: its vector may hold inf."""
    op = _op(backend)
    t = gated_tables()
    t.site[:, 1] = -1  # only the gated entries
    for s in range(4):
        t.vec[s, 0] = 6
    t.bank[6] = float("inf")
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(2))
    x[5] = float("nan")
    before = x.clone()
    slot = torch.tensor([0, 1, 2, 0, 1, 2])
    op(t, slot, x, None, torch.tensor([6, 7, 8, 9, 10, 11]), STEER_SITE)  # gates all 0
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_other", [True, False])
def test_triton_kernel_matches_reference_with_conditions(dtype, with_other):
    from graphtap.ops.steer_triton import steer_triton

    g = torch.Generator().manual_seed(3)
    N = 24
    tables = [gated_tables(seed=4), gated_tables(seed=4)]
    for t in tables:
        t.bank = t.bank.to(dtype)
        t.site[2, 1] = COND_SITE  # a steer at the condition's own site: scored after it
    slot = torch.randint(0, 5, (N,), generator=g)
    pos = torch.randint(3, 9, (N,), generator=g)
    pos[:4] = 5
    x = torch.randn(N, H, generator=g).to(dtype)
    other = torch.randn(N, H, generator=g).to(dtype) if with_other else None
    outs = []
    for t, op in zip(tables, (steer_reference, steer_triton)):
        y = x.clone()
        for site in (COND_SITE, STEER_SITE):
            op(t, slot, y, other, pos, site)
        outs.append(y)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=tol, rtol=tol)
    assert torch.equal(tables[0].gate, tables[1].gate)


def _spec(**cond):
    c = {"site": "blocks.1.hook_resid_post", "vector": [1.0] * H, "threshold": 0.5, **cond}
    return {"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "scale": 2.0,
                       "vector": [0.5] * H, "positions": "generated", "condition": c}]}


def test_normalised_condition():
    n = normalise(parse_spec(_spec(compare="below")), SHAPE)
    c = n.steer[0].condition
    assert (c.layer, c.kind, c.threshold, c.unit, c.below, c.sigmoid) == \
        (1, "resid_post", 0.5, True, True, False)
    assert c.key in n.vector_keys and len(n.vector_keys) == 2
    p = normalise(parse_spec(_spec(score="probe", bias=-1.0, activation="sigmoid")), SHAPE)
    assert (p.steer[0].condition.unit, p.steer[0].condition.bias,
            p.steer[0].condition.sigmoid) == (False, -1.0, True)


@pytest.mark.parametrize("change,field,words", [
    (dict(cond=dict(site="blocks.2.hook_resid_post")), "hooks.steer[0].condition.site",
     "must come before"),
    (dict(steer=dict(site="blocks.2.hook_resid_mid"), cond=dict(site="blocks.2.hook_resid_post")),
     "hooks.steer[0].condition.site", "must come before"),
    (dict(cond=dict(site="blocks.1.attn.hook_z")), "hooks.steer[0].condition.site",
     "residual stream"),
    (dict(cond=dict(site="blocks.0.hook_resid_post")), "hooks.steer[0].condition.site",
     "no op in this engine"),
    (dict(steer=dict(positions="all")), "hooks.steer[0].positions", "'generated' or"),
    (dict(steer=dict(positions={"start": 0, "end": 9})), "hooks.steer[0].positions",
     "last prompt token"),
    (dict(cond=dict(bias=1.0)), "hooks.steer[0].condition", "belong to score 'probe'"),
    (dict(cond=dict(vector=[1.0] * 3)), "hooks.steer[0].condition.vector", "length 3"),
    (dict(cond=dict(vector=[0.0] * H)), "hooks.steer[0].condition.vector", "non-zero"),
    (dict(cond=dict(vector="nope")), "hooks.steer[0].condition.vector", "no registered"),
    (dict(cond=dict(threshold=float("nan"))), "hooks.steer[0].condition.threshold", "finite"),
    (dict(cond=dict(threshold=1e39)), "hooks.steer[0].condition.threshold", "overflows"),
    (dict(cond=dict(compare="over")), "hooks.steer[0].condition.compare", ""),
    (dict(cond=dict(threshold=True)), "hooks.steer[0].condition.threshold", ""),
])
def test_invalid_conditions_name_the_field(change, field, words):
    spec = _spec(**change.get("cond", {}))
    spec["steer"][0].update(change.get("steer", {}))
    with pytest.raises(ValueError) as e:
        normalise(parse_spec(spec), SHAPE)
    assert str(e.value).startswith(field) and words in str(e.value), str(e.value)


def test_a_condition_may_gate_heads_at_z_of_a_later_layer():
    spec = {"steer": [{"site": "blocks.1.attn.hook_z", "op": "scale", "heads": [1],
                       "scale": 0.0, "positions": "generated",
                       "condition": {"site": "blocks.1.hook_resid_post", "vector": [1.0] * H,
                                     "threshold": 0.0}}]}
    with pytest.raises(ValueError, match="must come before"):  # post(1) follows z(1)
        normalise(parse_spec(spec), SHAPE)
    spec["steer"][0]["site"] = "blocks.2.hook_resid_post"
    spec["steer"][0].update(op="add", vector=[1.0] * H, heads=None)
    spec["steer"][0].pop("heads")
    assert normalise(parse_spec(spec), SHAPE).steer[0].condition is not None


def test_salt_covers_the_condition():
    salts = {steering_salt(normalise(parse_spec(s), SHAPE), 9) for s in [
        _spec(), _spec(threshold=0.25), _spec(compare="below"), _spec(vector=[2.0] * H),
        _spec(score="probe"), _spec(site="blocks.2.hook_resid_mid")]}
    plain = _spec()
    del plain["steer"][0]["condition"]
    salts.add(steering_salt(normalise(parse_spec(plain), SHAPE), 9))
    assert len(salts) == 7


def test_family_writes_the_condition_and_a_refilled_slot_starts_closed():
    from graphtap.engine.families.steer import SteerFamily
    from graphtap.engine.families.vectors import VectorBank
    from graphtap.spec.sites import SiteTable, expand_patterns

    sites = SiteTable(expand_patterns(sorted(SHAPE.configured_sites), SHAPE.num_layers))
    et = engine_tables(max_reqs=2, max_steers=3, max_vectors=4, hidden=H, max_len=L,
                       steer_width=H)
    fam = SteerFamily(et, sites, VectorBank(et.ops.steer))
    spec = normalise(parse_spec(_spec(score="probe", bias=0.25, activation="sigmoid",
                                      compare="below")), SHAPE)
    fam.add_request(1, "a", 7, spec)
    fam.apply_staged_writes()
    et.slots.apply()
    t = et.ops.steer
    assert int(t.cond_site[1, 0]) == sites.id_of(1, "resid_post")
    assert int(t.cond_mode[1, 0]) == COND_SIGMOID | COND_BELOW
    assert t.cond_coef[1, 0].tolist() == [0.25, 0.5] and int(t.cond_pos[1, 0]) == 6
    assert int(t.cond_site[1, 1]) == -1 and int(t.gate[1, 0]) == 0
    assert fam.bank.held() == 2
    t.gate[1, 0] = 1  # decided on by the op
    fam.add_request(1, "a", 7, spec)  # resumed after preemption: decided again
    et.slots.apply()
    assert int(t.gate[1, 0]) == 0
    fam.remove_request("a")
    et.slots.apply()
    assert int(t.cond_site[1, 0]) == -1 and fam.bank.held() == 0
    assert np.all(et.slots.host_view(et.steer.gate) == 0)
