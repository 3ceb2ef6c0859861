"""Steering without an engine: the op (torch reference vs Triton kernel in Triton's
interpreter), position bitmaps, spec validation, admission and the cache salt."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphtap.frontend import GraphtapFrontend
from graphtap.ops.steer import steer_reference
from graphtap.spec import ModelShape, NormalisedSpec, normalise, parse_spec, steering_salt
from graphtap.spec.positions import position_bitmap
from helpers import engine_tables

H, R, E, V, N, L = 64, 4, 3, 5, 24, 100
BANK_SHAPE = ModelShape(num_layers=4, hidden_size=H, max_model_len=L, max_steers=E,
                        max_vectors=8, configured_sites={"blocks.1.hook_resid_post"})


def random_tables(dtype, seed=0):
    """Steer tables with some entries per slot (slot R, the sentinel, never acts) and a
    random token -> slot map; returns (steer tables, tok_slot)."""
    g = torch.Generator().manual_seed(seed)
    et = engine_tables(max_reqs=R, max_tokens=N, max_steers=E, max_vectors=V, hidden=H,
                       max_len=L, dtype=dtype)
    t = et.ops.steer
    t.bank[1:] = torch.randn(V, H, generator=g).to(dtype)
    t.inv_norm[1:] = 1.0 / t.bank[1:].float().norm(dim=1)
    words = t.pos.shape[2]
    for slot in range(R):
        for e in range(E):
            if (slot + e) % 4 == 3:
                continue  # some unused entries
            t.site[slot, e] = (slot + e) % 2
            t.vec[slot, e] = 1 + (slot * E + e) % V
            op = (slot + 2 * e) % 5  # add, set_projection, ablate, clamp, scale
            lo, hi = [(-math.inf, math.inf), (1.5, 1.5), (0.0, 0.0), (-0.3, 0.2),
                      (-math.inf, math.inf)][op]
            t.coef[slot, e] = torch.tensor([2.5 if op == 0 else 0.0, lo, hi,
                                            -0.75 if op == 4 else 0.0])
            rule = ["all", "prompt", "generated", {"start": 3, "end": 9}][(slot + e) % 4]
            t.pos[slot, e] = torch.from_numpy(position_bitmap(rule, 6, L, words))
    tok_slot = torch.randint(0, R + 1, (N,), generator=g)
    return t, tok_slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_other", [True, False])
def test_triton_kernel_matches_reference(dtype, with_other):
    from graphtap.ops.steer_triton import steer_triton  # runs in Triton's interpreter here

    t, tok_slot = random_tables(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, H, generator=g).to(dtype)
    other = torch.randn(N, H, generator=g).to(dtype) if with_other else None
    pos = torch.randint(0, 12, (N,), generator=g)
    ref, tri = x.clone(), x.clone()
    steer_reference(t, tok_slot, ref, other, pos, 1)
    steer_triton(t, tok_slot, tri, other, pos, 1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(tri.float(), ref.float(), atol=tol, rtol=tol)
    assert not torch.equal(ref, x), "the random tables should steer some rows"


def test_inactive_rows_are_bit_identical():
    t, tok_slot = random_tables(torch.float32)
    tok_slot[: N // 2] = R  # the sentinel
    x = torch.randn(N, H)
    y = x.clone()
    steer_reference(t, tok_slot, y, torch.randn(N, H), torch.arange(N), 0)
    assert torch.equal(y[: N // 2], x[: N // 2])
    tok_slot.fill_(R)
    z = x.clone()
    steer_reference(t, tok_slot, z, None, torch.arange(N), 0)
    assert torch.equal(z, x)


def _poisoned(t, tok_slot):
    """Stale table state of earlier requests: inf/NaN in every vector and coefficient
    that no active entry uses (unused entries, the sentinel, freed bank rows)."""
    used = {int(t.vec[s, e]) for s in range(R) for e in range(E) if int(t.site[s, e]) >= 0}
    for i in range(V + 1):
        if i not in used:
            t.bank[i] = float("nan") if i % 2 else float("inf")
            t.inv_norm[i] = float("inf")
    for s in range(R + 1):
        for e in range(E):
            if s == R or int(t.site[s, e]) < 0:
                t.coef[s, e] = torch.tensor([float("nan"), float("inf"), -float("inf"),
                                             float("nan")])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_inactive_entries_contribute_exactly_zero_whatever_the_tables_hold(backend):
    """Issue 16 items 1 and 10: a request must not inherit anything from the garbage an
    earlier one left in its slot's rows, and padding rows whose stream is inf/NaN/-0
    must come out bit for bit as they went in (0 * inf is NaN: stock never multiplies)."""
    from graphtap.ops.steer_triton import steer_triton

    op = steer_reference if backend == "torch" else steer_triton
    t, tok_slot = random_tables(torch.float32)
    for s in range(R):  # leave unused entries in every slot, and vectors nobody uses
        t.site[s, E - 1] = -1
    clean_x = torch.randn(N, H, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(N) % 12
    clean = clean_x.clone()
    op(t, tok_slot, clean, None, pos, 1)
    _poisoned(t, tok_slot)
    x = clean_x.clone()
    pad = tok_slot == R
    x[pad] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")]).repeat(H // 4)
    before = x.clone()
    op(t, tok_slot, x, None, pos, 1)
    assert torch.equal(x[~pad].view(torch.int32), clean[~pad].view(torch.int32))
    assert torch.equal(x[pad].view(torch.int32), before[pad].view(torch.int32))
    assert pad.any() and not torch.equal(clean, clean_x)


def test_ops_semantics_on_one_row():
    t = engine_tables(max_reqs=1, max_tokens=1, max_steers=1, max_vectors=1, hidden=4,
                      max_len=8).ops.steer
    v = torch.tensor([3.0, 4.0, 0.0, 0.0])
    t.bank[1], t.inv_norm[1] = v, 0.2
    t.site[0, 0], t.vec[0, 0] = 0, 1
    t.pos[0, 0] = torch.from_numpy(position_bitmap("all", 1, 8, 1))
    h = torch.tensor([[1.0, 2.0, 5.0, 0.0]])  # <h, v_hat> = (3 + 8) / 5 = 2.2
    u = v / 5

    def run(a, lo, hi, g=0.0):
        t.coef[0, 0] = torch.tensor([a, lo, hi, g])
        x = h.clone()
        steer_reference(t, torch.tensor([0]), x, None, torch.tensor([0]), 0)
        return x[0]

    torch.testing.assert_close(run(2.0, -math.inf, math.inf), h[0] + 2 * v)      # add
    torch.testing.assert_close(run(0.0, 1.0, 1.0) @ u, torch.tensor(1.0))         # set_projection
    torch.testing.assert_close(run(0.0, 0.0, 0.0) @ u, torch.tensor(0.0))         # ablate
    torch.testing.assert_close(run(0.0, -1.0, 1.5) @ u, torch.tensor(1.5))        # clamp
    torch.testing.assert_close(run(0.0, -1.0, 3.0), h[0])                         # clamp, inside
    # scale (g = scale - 1) the elements v selects: with v a 0/1 mask, heads of z
    t.bank[1] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    torch.testing.assert_close(run(0.0, -math.inf, math.inf, -1.0), torch.tensor([0.0, 2, 0, 0]))
    torch.testing.assert_close(run(0.0, -math.inf, math.inf, 1.0), torch.tensor([2.0, 2, 10, 0]))


def test_position_bitmap():
    words = 2
    def bits(rule, prompt_len=5):
        w = position_bitmap(rule, prompt_len, 40, words).view(np.uint32)
        return [p for p in range(64) if (int(w[p // 32]) >> (p % 32)) & 1]
    assert bits("all") == list(range(40))
    assert bits("prompt") == [0, 1, 2, 3, 4]
    assert bits("generated") == list(range(5, 40))
    assert bits("last_prompt") == [4]
    assert bits({"start": 30, "end": 34}) == [30, 31, 32, 33]
    assert bits([12, 33, 39]) == [12, 33, 39]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 95), max_size=20), st.integers(1, 3))
def test_position_bitmap_sets_bit_j_of_word_w_for_position_32w_plus_j(positions, words):
    positions = sorted({p for p in positions if p < 32 * words})
    w = position_bitmap(positions, 1, 32 * words, words)
    assert w.dtype == np.int32 and w.shape == (words,)
    assert [p for p in range(32 * words) if (int(w.view(np.uint32)[p // 32]) >> (p % 32)) & 1] \
        == positions


SHAPE = ModelShape(num_layers=4, hidden_size=8, max_model_len=64, max_steers=3, max_vectors=2,
                   configured_sites={f"blocks.{i}.hook_resid_{k}" for i in range(4)
                                     for k in ("pre", "mid", "post")} - {"blocks.3.hook_resid_mid"})


def steer(**kw):
    base = {"site": "blocks.1.hook_resid_post", "op": "add", "vector": [1.0] * 8, "scale": 2.0}
    return {**base, **kw}


@pytest.mark.parametrize("entry, field, words", [
    (steer(site="blocks.1.hook_mlp_out"), "hooks.steer[0].site", "unknown site"),
    (steer(site="blocks.9.hook_resid_post"), "hooks.steer[0].site", "out of range"),
    (steer(site="blocks.3.hook_resid_mid"), "hooks.steer[0].site", "no op in this engine"),
    (steer(vector=[1.0] * 7), "hooks.steer[0].vector", "hidden size is 8"),
    (steer(vector=[1.0] * 7 + [float("nan")]), "hooks.steer[0].vector", "finite"),
    (steer(vector=[1.0] * 7 + [float("inf")]), "hooks.steer[0].vector", "finite"),
    (steer(scale=float("inf")), "hooks.steer[0].scale", "finite"),
    (steer(op="multiply"), "hooks.steer[0].op", "'add'"),
    (steer(op="set_projection"), "hooks.steer[0]", "needs 'target'"),
    (steer(op="clamp", min=1.0, max=0.0), "hooks.steer[0]", "greater than max"),
    (steer(op="ablate", vector=[0.0] * 8), "hooks.steer[0]", "non-zero vector"),
    (steer(positions="middle"), "hooks.steer[0].positions", "not one of all"),
    (steer(positions=[1, -2]), "hooks.steer[0].positions", "integers >= 0"),
    (steer(positions={"start": 5, "end": 2}), "hooks.steer[0].positions", "greater than start"),
    (steer(positions=[3, 64]), "hooks.steer[0].positions", "beyond max_model_len"),
    (steer(colour="red"), "hooks.steer[0].colour", "Extra inputs"),
])
def test_invalid_specs_name_the_field(entry, field, words):
    with pytest.raises(ValueError) as e:
        normalise(parse_spec({"steer": [entry]}), SHAPE)
    assert str(e.value).startswith(field + ":") or str(e.value).startswith(field), str(e.value)
    assert words in str(e.value), str(e.value)


def test_too_many_steers_and_vectors():
    many = {"steer": [steer(vector=[float(i + 1)] * 8) for i in range(3)]}
    with pytest.raises(ValueError, match=r"hooks.steer: 3 distinct vectors.*max_vectors"):
        normalise(parse_spec(many), SHAPE)
    with pytest.raises(ValueError, match=r"hooks.steer: 4 steers.*max_steers"):
        normalise(parse_spec({"steer": [steer()] * 4}), SHAPE)
    with pytest.raises(ValueError, match=r"^hooks: not valid JSON"):
        parse_spec("{nope")


def test_salt_is_a_content_hash():
    a = normalise(parse_spec({"steer": [steer()]}), SHAPE)
    b = normalise(parse_spec({"steer": [steer()]}), SHAPE)
    c = normalise(parse_spec({"steer": [steer(scale=2.5)]}), SHAPE)
    assert steering_salt(a) == steering_salt(b) != steering_salt(c)
    assert steering_salt(NormalisedSpec()) is None


class _Params:
    def __init__(self, hooks=None, extra_args=None, max_tokens=16):
        self.hooks, self.extra_args, self.max_tokens = hooks, extra_args, max_tokens


class _Request:
    def __init__(self, rid, params):
        self.request_id, self.sampling_params = rid, params


def test_frontend_salts_and_admits_within_the_vector_table():
    fe = GraphtapFrontend(SHAPE)
    p1 = _Params({"steer": [steer(vector=[1.0] * 8)]})
    assert fe.process_request("r1", p1, None).startswith("graphtap:")
    salted = fe.process_request("r1", p1 := _Params({"steer": [steer(vector=[1.0] * 8)]}), "user")
    assert salted.startswith("graphtap:") and salted.endswith("|user:user")
    plain = _Params()
    assert fe.process_request("r0", plain, "user") == "user:user" and plain.hooks is None
    http = _Params(extra_args={"hooks": '{"steer": [%s]}' % str(steer()).replace("'", '"')})
    assert fe.process_request("r2", http, None)
    assert NormalisedSpec.from_wire(http.hooks).steer[0].a == 2.0
    p2 = _Params({"steer": [steer(vector=[2.0] * 8)]})
    p3 = _Params({"steer": [steer(vector=[3.0] * 8)]})
    fe.process_request("r2", p2, None)
    fe.process_request("r3", p3, None)
    fe.admit_request(_Request("a", p1))
    fe.admit_request(_Request("b", p2))
    fe.admit_request(_Request("b2", p2))  # same vector: no new slot
    with pytest.raises(ValueError, match=r"hooks.steer: .*live requests hold 2 of the 2"):
        fe.admit_request(_Request("c", p3))
    fe.release_request("a")
    fe.admit_request(_Request("c", p3))


@pytest.mark.parametrize("entry, field, words", [
    ({"site": "blocks.1.hook_attn_q"}, "hooks.capture[0].site", "unknown site"),
    ({"site": "blocks.3.hook_resid_mid"}, "hooks.capture[0].site", "no op in this engine"),
    ({"site": "blocks.1.hook_resid_pre", "dtype": "int8"}, "hooks.capture[0].dtype", "'model'"),
    ({"site": "blocks.1.hook_resid_pre", "positions": "soon"}, "hooks.capture[0].positions",
     "not one of"),
    ({"site": "blocks.1.hook_resid_pre", "heads": [1]}, "hooks.capture[0].heads", "has no heads"),
])
def test_invalid_captures_name_the_field(entry, field, words):
    with pytest.raises(ValueError) as e:
        normalise(parse_spec({"capture": [entry]}), SHAPE)
    assert str(e.value).startswith(field) and words in str(e.value), str(e.value)


def test_capture_limits_and_prefix_cache_reads():
    twice = {"capture": [{"site": "blocks.1.hook_resid_pre"}, {"site": "blocks.1.hook_resid_pre"}]}
    with pytest.raises(ValueError, match=r"hooks.capture\[1\].site: .* captured twice"):
        normalise(parse_spec(twice), SHAPE)
    many = {"capture": [{"site": f"blocks.{i}.hook_resid_pre"} for i in range(4)] * 3}
    with pytest.raises(ValueError, match=r"hooks.capture: 12 captures.*max_captures"):
        normalise(parse_spec(many), SHAPE)
    fe = GraphtapFrontend(SHAPE)
    p = _Params({"capture": [{"site": "blocks.0.hook_resid_post"}]})
    p.skip_reading_prefix_cache = None
    assert fe.process_request("r", p, "salt") == "user:salt"  # capture alone changes no KV
    assert p.skip_reading_prefix_cache is True  # but must recompute cached prompt positions
    p2 = _Params({"capture": [{"site": "blocks.0.hook_resid_post"}]})
    p2.n = 2
    with pytest.raises(ValueError, match=r"^hooks.capture: not supported with n > 1"):
        fe.process_request("r", p2, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_other", [True, False])
def test_capture_kernel_matches_reference(with_other, dtype):
    from graphtap.ops.capture import capture_reference
    from graphtap.ops.capture_triton import capture_triton

    def tables():
        t = engine_tables(max_reqs=2, max_tokens=N, num_sites=3, capture_rows=10,
                          capture_width=H, max_len=L, dtype=dtype).ops.capture
        g = torch.Generator().manual_seed(3)
        t.dst[1] = 10  # the trash row
        t.dst[1, torch.randperm(N, generator=g)[:8]] = torch.arange(8)  # rows are unique
        return t
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(N, 3 * H, generator=g).to(dtype)
    x = qkv[:, H:2 * H].view(N, 4, H // 4)  # a strided q/k/v-style view
    other = torch.randn(N, 4, H // 4, generator=g).to(dtype) if with_other else None
    ref, tri = tables(), tables()
    capture_reference(ref, x, other, 1)
    assert capture_triton(tri, x, other, 1)
    kept = ref.dst[1] < 10
    assert kept.any()
    # Triton's interpreter truncates float32 -> bfloat16 whatever rounding is asked for
    # (a GPU rounds to nearest even): one bf16 ulp apart at most here.
    exact = dtype == torch.float32
    torch.testing.assert_close(tri.buf[:10], ref.buf[:10], atol=0, rtol=0 if exact else 2 ** -7)
    # Summed in float32, rounded once into the buffer's dtype.
    want = (x.reshape(N, -1).float() + (other.reshape(N, -1).float() if with_other else 0))
    rows = ref.dst[1][kept]
    torch.testing.assert_close(ref.buf[rows], want[kept].to(dtype), atol=0, rtol=0)


def test_save_to_needs_a_save_root():
    spec = parse_spec({"capture": [{"site": "blocks.0.hook_resid_post"}], "save_to": "x"})
    with pytest.raises(ValueError, match=r"^hooks.save_to: this engine has no hook_config.save_root"):
        normalise(spec, SHAPE)
    with pytest.raises(ValueError, match=r"^hooks.save_to: nothing is captured"):
        normalise(parse_spec({"save_to": "x"}), SHAPE)


def test_hook_manager_refuses_the_v1_model_runner():
    """The slots are in Model Runner V2 only: under vLLM's fallback to the V1 runner a
    configured manager would be ignored (captures silently empty), so it refuses to
    start (patch 0003). Checked end to end once: a CPU run without TRITON_INTERPRET."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.hooks import hook_manager_cls

    from graphtap.seam import GraphtapHookManager

    cfg = lambda v2: SimpleNamespace(  # noqa: E731
        additional_config={"hook_manager": "graphtap"}, use_v2_model_runner=v2)
    with pytest.raises(ValueError, match=r"hook_manager='graphtap' needs Model Runner V2"):
        hook_manager_cls(cfg(False))
    assert hook_manager_cls(cfg(True)) is GraphtapHookManager
    # without a manager nothing is asked of the runner
    assert hook_manager_cls(SimpleNamespace(additional_config={})) is None


def test_a_full_vector_bank_refuses_the_request_not_the_engine():
    """Issue 16 item 9: when more live requests hold vectors than the worker's table has
    rows (frontends that disagree with the worker), the worker raised and the engine
    died; now that request alone is refused, with its error, and runs no steering."""
    from graphtap.courier import assemble
    from graphtap.engine.families.steer import SteerFamily
    from graphtap.engine.families.vectors import VectorBank
    from graphtap.spec.sites import Site, SiteTable

    et = engine_tables(max_reqs=R, max_tokens=N, max_steers=E, max_vectors=2, hidden=H,
                       max_len=L)
    family = SteerFamily(et, SiteTable([Site(1, "resid_post")]), VectorBank(et.ops.steer))

    def spec(seed):
        vec = np.random.default_rng(seed).standard_normal(H).astype(np.float32).tolist()
        return normalise(parse_spec({"steer": [{"site": "blocks.1.hook_resid_post",
                                                "op": "add", "vector": vec}]}), BANK_SHAPE)

    for slot in range(3):
        family.add_request(slot, f"r{slot}", 4, spec(slot))
    et.slots.apply()
    part = family.snapshot()
    errors = part.per_request()
    assert list(errors) == ["r2"]
    message = assemble([errors["r2"]]).error
    assert message.startswith("hooks.steer: refused by the engine") and "unsteered" in message
    assert (et.ops.steer.site[2] == -1).all()  # slot 2 steers nothing
    assert family.snapshot() is None  # reported once
    family.remove_request("r0")
    family.add_request(0, "r3", 4, spec(3))  # a row is free again
    et.slots.apply()
    assert family.snapshot() is None and (et.ops.steer.site[0] >= 0).any()


def test_a_steering_slots_positions_are_its_rules_for_its_prompt_whatever_came_before(
        monkeypatch):
    """SteerFamily remembers a bitmap per (position rule, prompt length), a burst's
    requests sharing one: each slot still gets its own rule's bitmap for its own prompt
    length, as position_bitmap makes it, and the family keeps at most BITMAPS."""
    from graphtap.engine.families import steer as steer_module
    from graphtap.engine.families.steer import SteerFamily
    from graphtap.engine.families.vectors import VectorBank
    from graphtap.spec.positions import position_bitmap
    from graphtap.spec.sites import Site, SiteTable

    monkeypatch.setattr(steer_module, "BITMAPS", 3)
    et = engine_tables(max_reqs=R, max_tokens=N, max_steers=E, max_vectors=4, hidden=H,
                       max_len=L)
    family = SteerFamily(et, SiteTable([Site(1, "resid_post")]), VectorBank(et.ops.steer))
    vec = [0.5] * H

    def spec(positions):
        return normalise(parse_spec({"steer": [{"site": "blocks.1.hook_resid_post",
                                                "op": "add", "vector": vec,
                                                "positions": positions}]}), BANK_SHAPE)

    words = et.ops.steer.pos.shape[-1]
    for n, (positions, prompt_len) in enumerate(
            [("all", 4), ("all", 4), ("prompt", 4), ("all", 7), ([1, 2], 4), ("all", 4)]):
        s = spec(positions)
        family.add_request(n % R, f"r{n}", prompt_len, s)
        et.slots.apply()
        want = position_bitmap(s.steer[0].positions, prompt_len, L, words)
        np.testing.assert_array_equal(et.ops.steer.pos[n % R, 0].numpy(), want)
        family.remove_request(f"r{n}")
        assert len(family._bitmaps) <= 3
