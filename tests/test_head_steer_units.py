"""Head interventions at attn.hook_z without an engine: the spec (what is refused, with the
field), what the entries become (a row-wide vector and g), and the op on a z row."""
import math

import numpy as np
import pytest
import torch

from graphtap.ops.steer import steer_reference
from graphtap.spec import ModelShape, normalise, parse_spec, steering_salt
from graphtap.spec.positions import position_bitmap
from helpers import engine_tables

HEADS, D = 4, 8
SHAPE = ModelShape(num_layers=2, hidden_size=16, max_model_len=64, max_steers=4,
                   max_vectors=4, num_heads=HEADS, num_kv_heads=2, head_dim=D,
                   configured_sites={"blocks.1.attn.hook_z", "blocks.1.attn.hook_q",
                                     "blocks.1.hook_resid_post"})
Z = "blocks.1.attn.hook_z"


def entry(**kw):
    return normalise(parse_spec({"steer": [{"site": Z, **kw}]}), SHAPE).steer[0]


def test_scale_becomes_a_head_mask_and_a_gain():
    e = entry(op="scale", heads=[2, 0, 2], scale=0.0)
    mask = np.frombuffer(e.vector, np.float32).reshape(HEADS, D)
    assert mask[[0, 2]].min() == 1.0 and mask[[1, 3]].max() == 0.0
    assert (e.a, e.lo, e.hi, e.g) == (0.0, -math.inf, math.inf, -1.0)


def test_add_per_head_and_whole_row():
    v = list(range(1, D + 1))
    e = entry(op="add", heads=[3], vector=v, scale=2.0)
    row = np.frombuffer(e.vector, np.float32).reshape(HEADS, D)
    assert row[3].tolist() == v and not row[:3].any() and (e.a, e.g) == (2.0, 0.0)
    full = entry(op="add", vector=[1.0] * (HEADS * D))
    assert len(full.vector) == HEADS * D * 4


@pytest.mark.parametrize("kw, field, words", [
    (dict(op="scale", scale=0.0), "hooks.steer[0]", "needs 'heads'"),
    (dict(op="scale", heads=[1], vector=[1.0] * D), "hooks.steer[0]", "takes no vector"),
    (dict(op="scale", heads=[4], scale=0.0), "hooks.steer[0].heads", "out of range"),
    (dict(op="scale", heads=[1], scale=1e6), "hooks.steer[0]", "beyond"),
    (dict(op="add", heads=[1], vector=[1.0] * (D + 1)), "hooks.steer[0].vector", "needs 8"),
    (dict(op="add", vector=[1.0] * D), "hooks.steer[0].vector", "needs 32"),
    (dict(op="add"), "hooks.steer[0]", "needs 'vector'"),
    (dict(op="ablate", vector=[1.0] * (HEADS * D)), "hooks.steer[0].op", "only 'add' and"),
    (dict(op="add", heads=[1.5], vector=[1.0] * D), "hooks.steer[0].heads", "integer"),
    (dict(site="blocks.1.attn.hook_q", op="add", vector=[1.0] * 32), "hooks.steer[0].site",
     "captured only"),
    (dict(site="blocks.1.hook_resid_post", op="scale", heads=[0]), "hooks.steer[0].op",
     "has no heads"),
    (dict(site="blocks.1.hook_resid_post", op="add", heads=[0], vector=[1.0] * 16),
     "hooks.steer[0].heads", "has no heads"),
])
def test_invalid_head_steers_name_the_field(kw, field, words):
    with pytest.raises(ValueError) as e:
        normalise(parse_spec({"steer": [{"site": Z, **kw}]}), SHAPE)
    assert str(e.value).startswith(field) and words in str(e.value), str(e.value)


def test_salt_tells_head_edits_apart():
    """Head edits change every later layer's keys: their salt is a content hash that
    separates scales, heads and plain requests."""
    a = normalise(parse_spec({"steer": [{"site": Z, "op": "scale", "heads": [1],
                                         "scale": 0.0}]}), SHAPE)
    b = normalise(parse_spec({"steer": [{"site": Z, "op": "scale", "heads": [1],
                                         "scale": 0.5}]}), SHAPE)
    c = normalise(parse_spec({"steer": [{"site": Z, "op": "scale", "heads": [2],
                                         "scale": 0.0}]}), SHAPE)
    salts = {steering_salt(x) for x in (a, b, c)}
    assert len(salts) == 3 and None not in salts


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_op_on_z_rows(backend):
    """On z rows narrower than the bank (the bank is as wide as the widest steered row):
    scale 0 zeroes exactly the chosen heads, add reaches only its heads, untouched
    tokens stay bit for bit."""
    from graphtap.ops.steer_triton import steer_triton

    op = steer_reference if backend == "torch" else steer_triton
    et = engine_tables(max_reqs=2, max_tokens=6, max_steers=2, max_vectors=2, hidden=48,
                       steer_width=48, max_len=16)
    t = et.ops.steer
    mask = torch.zeros(48)
    mask[1 * D:2 * D] = 1.0
    add = torch.zeros(48)
    add[3 * D:4 * D] = torch.arange(D, dtype=torch.float32)
    t.bank[1], t.bank[2] = mask, add
    t.inv_norm[1], t.inv_norm[2] = 1 / mask.norm(), 1 / add.norm()
    t.site[0, :2] = 0
    t.vec[0, 0], t.vec[0, 1] = 1, 2
    t.coef[0, 0] = torch.tensor([0.0, -math.inf, math.inf, -1.0])  # scale 0
    t.coef[0, 1] = torch.tensor([2.0, -math.inf, math.inf, 0.0])  # add 2 * v
    t.pos[0, :2] = torch.from_numpy(position_bitmap("all", 3, 16, t.pos.shape[2]))
    tok_slot = torch.tensor([0, 0, 2, 0, 2, 2])  # 2: the sentinel
    z = torch.randn(6, HEADS, D)
    before = z.clone()
    op(t, tok_slot, z.view(6, -1), None, torch.arange(6), 0)
    on = tok_slot == 0
    assert torch.equal(z[~on], before[~on])
    assert z[on][:, 1].abs().max() == 0.0
    torch.testing.assert_close(z[on][:, 3], before[on][:, 3] + 2 * torch.arange(D).float())
    assert torch.equal(z[on][:, [0, 2]], before[on][:, [0, 2]])
