"""Probes without an engine: the spec (refusals name the field), the op (torch reference
vs Triton kernel in Triton's interpreter, both against a plain formula), and the family
end to end on engine tables (rows routed, scored, split per request as probe:<site>)."""
import numpy as np
import pytest
import torch

from graphtap.courier.pack import unpack
from graphtap.ops.probe import probe_reference
from graphtap.spec import ModelShape, normalise, parse_spec
from helpers import engine_tables

H, R, N, L, C, P = 32, 3, 10, 64, 2, 3
SHAPE = ModelShape(num_layers=2, hidden_size=H, max_model_len=L, max_steers=2, max_vectors=4,
                   max_probes=2, probe_width=P,
                   configured_sites={"blocks.0.hook_resid_post", "blocks.1.hook_resid_post",
                                     "blocks.1.attn.hook_q"})
SITE = "blocks.1.hook_resid_post"


def w(seed, n=H):
    return np.random.default_rng(seed).normal(size=n).astype(np.float32).tolist()


def test_entry_carries_weights_bias_and_activation():
    spec = normalise(parse_spec({"probe": [{"site": SITE, "weights": [w(0), w(1)],
                                            "bias": [0.5, -1.0], "activation": "sigmoid",
                                            "positions": "last_prompt"}]}), SHAPE)
    (e,) = spec.probe
    assert e.name == f"probe:{SITE}" and e.sigmoid and e.bias == (0.5, -1.0)
    assert np.frombuffer(e.vectors[1], np.float32).tolist() == w(1)
    assert spec.vector_keys == set(e.keys) and spec.captures_anything


@pytest.mark.parametrize("probe, field, words", [
    ({"site": SITE, "weights": []}, "hooks.probe[0].weights", "at least 1"),
    ({"site": SITE, "weights": [w(0, H - 1)]}, "hooks.probe[0].weights[0]", "hidden size"),
    ({"site": SITE, "weights": [w(0)], "bias": [1.0, 2.0]}, "hooks.probe[0]", "bias has 2"),
    ({"site": SITE, "weights": [[float("nan")] * H]}, "hooks.probe[0].weights", "finite"),
    ({"site": SITE, "weights": [w(i) for i in range(P + 1)]}, "hooks.probe[0].weights",
     "probe_width"),
    ({"site": SITE, "weights": ["nope"]}, "hooks.probe[0].weights[0]", "no registered vector"),
    ({"site": "blocks.1.attn.hook_q", "weights": [w(0)]}, "hooks.probe[0].site",
     "residual stream"),
    ({"site": SITE, "weights": [w(0)], "activation": "relu"}, "hooks.probe[0].activation",
     "'none'"),
    ({"site": SITE, "weights": [w(0)], "bias": [1e39]}, "hooks.probe[0].bias", "float32"),
])
def test_invalid_probes_name_the_field(probe, field, words):
    with pytest.raises(ValueError) as e:
        normalise(parse_spec({"probe": [probe]}), SHAPE)
    assert str(e.value).startswith(field) and words in str(e.value), str(e.value)


def test_probe_weights_from_a_safetensors_file(tmp_path):
    """A probe saved as safetensors (weight [P, hidden], bias, activation): offline its
    fields go into the entry (load_probe); in a vectors_dir it registers by its stem and
    `"weights": name` takes its rows, bias and activation (the entry's own win)."""
    from graphtap.spec import VectorRegistry
    from graphtap.vectors import load_probe, save_probe

    weight, bias = np.array([w(0), w(1)]), [0.5, -1.0]
    save_probe(tmp_path / "truth.safetensors", weight, bias, "sigmoid", {"site": SITE})
    fields = load_probe(tmp_path / "truth.safetensors")
    assert fields == {"weights": weight.tolist(), "bias": bias, "activation": "sigmoid"}
    inline = normalise(parse_spec({"probe": [{"site": SITE, **fields}]}), SHAPE).probe[0]
    reg = VectorRegistry(H, 8)
    assert reg.load_dir(str(tmp_path)) == 1
    assert reg.list() == [{"name": "truth", "probe": 2, "dim": H, "activation": "sigmoid"}]
    named = normalise(parse_spec({"probe": [{"site": SITE, "weights": "truth"}]}), SHAPE,
                      reg).probe[0]
    assert (named.vectors, named.bias, named.sigmoid) == (inline.vectors, inline.bias, True)
    own = normalise(parse_spec({"probe": [{"site": SITE, "weights": "truth", "bias": [0, 0],
                                           "activation": "none"}]}), SHAPE, reg).probe[0]
    assert own.bias == (0.0, 0.0) and not own.sigmoid
    for probe, words in [({"weights": "nope"}, "no registered probe"),
                         ({"weights": "truth", "bias": [1.0]}, "1 values for the 2 rows")]:
        with pytest.raises(ValueError, match=words):
            normalise(parse_spec({"probe": [{"site": SITE, **probe}]}), SHAPE, reg)
    save_probe(tmp_path / "wide.safetensors", np.ones((2, H + 1)))
    with pytest.raises(ValueError, match="wide.safetensors: vector: shape"):
        VectorRegistry(H, 8).load_dir(str(tmp_path))


def test_probe_limits():
    two = {"probe": [{"site": SITE, "weights": [w(0)]}, {"site": SITE, "weights": [w(1)]}]}
    with pytest.raises(ValueError, match=r"hooks.probe\[1\].site: .* appears twice"):
        normalise(parse_spec(two), SHAPE)
    many = {"probe": [{"site": f"blocks.{i % 2}.hook_resid_post", "weights": [w(i)]}
                      for i in range(3)]}
    with pytest.raises(ValueError, match=r"hooks.probe: 3 probe sites.*max_probes"):
        normalise(parse_spec(many), SHAPE)
    vectors = {"probe": [{"site": SITE, "weights": [w(0), w(1), w(2)]}],
               "steer": [{"site": SITE, "op": "add", "vector": w(3)},
                         {"site": SITE, "op": "add", "vector": w(4)}]}
    with pytest.raises(ValueError, match=r"hooks: 5 distinct vectors.*max_vectors"):
        normalise(parse_spec(vectors), SHAPE)


def _tables(seed=0):
    """Probe tables with entries in slots 0 and 1, routed rows for some tokens."""
    g = torch.Generator().manual_seed(seed)
    et = engine_tables(max_reqs=R, max_tokens=N, max_len=L, hidden=H, num_sites=2,
                       max_vectors=6, max_probes=C, probe_width=P, probe_rows=6)
    t, bank = et.ops.probe, et.ops.steer.bank
    bank[1:] = torch.randn(6, H, generator=g)
    t.entry_site[0, 0], t.entry_site[0, 1] = 0, 1  # slot 0 probes sites 0 and 1
    t.entry_site[1, 1] = 1  # slot 1: site 1 in its second entry
    t.entry_vec[0, 1, :2] = torch.tensor([1, 2], dtype=torch.int32)
    t.entry_bias[0, 1, :2] = torch.tensor([0.25, -0.5])
    t.entry_vec[1, 1, :3] = torch.tensor([3, 4, 5], dtype=torch.int32)
    t.entry_bias[1, 1, :3] = torch.tensor([1.0, 0.0, -1.0])
    t.entry_act[1, 1] = 1
    tok_slot = torch.tensor([0, 0, 1, 1, 1, 3, 3, 0, 1, 3])  # 3: the sentinel
    t.dst[1] = t.rows  # trash
    t.dst[1, :5] = torch.arange(5)
    t.dst[1, 8] = 5
    return t, bank, tok_slot


@pytest.mark.parametrize("with_other", [False, True])
def test_kernel_and_reference_score_like_the_formula(with_other):
    from graphtap.ops.probe_triton import probe_triton

    x = torch.randn(N, H, generator=torch.Generator().manual_seed(7))
    other = torch.randn(N, H) if with_other else None
    ref, bank, tok_slot = _tables()
    tri, _, _ = _tables()
    probe_reference(ref, bank, tok_slot, x, other, torch.arange(N), 1)
    probe_triton(tri, bank, tok_slot, x, other, torch.arange(N), 1)
    stream = x + (other if with_other else 0)
    for row, tok in [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 8)]:
        slot = int(tok_slot[tok])
        vec = ref.entry_vec[slot, 1].long()
        want = stream[tok] @ bank[vec].T + ref.entry_bias[slot, 1]
        if slot == 1:
            want = torch.sigmoid(want)
        torch.testing.assert_close(ref.buf[row], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tri.buf[row], want, atol=1e-5, rtol=1e-5)
    assert ref.buf[0, 2] == ref.entry_bias[0, 1, 2]  # an unused score: the zero row


def test_family_scores_and_splits_per_request():
    """ProbeFamily on engine tables: entries staged, rows routed on the device, scored,
    copied home and split per request under probe:<site> with their positions."""
    from types import SimpleNamespace

    from graphtap.engine.families.probe import ProbeFamily
    from graphtap.engine.families.vectors import VectorBank
    from graphtap.engine.router import TokenRouter
    from graphtap.ops.backend import TORCH
    from graphtap.spec import parse_site
    from graphtap.spec.sites import SiteTable

    sites = SiteTable([parse_site("blocks.0.hook_resid_post", 2), parse_site(SITE, 2)])
    et = engine_tables(max_reqs=R, max_tokens=N, max_len=L, hidden=H, num_sites=2,
                       max_vectors=6, max_probes=C, probe_width=P, probe_rows=16)
    bank = VectorBank(et.ops.steer)
    fam = ProbeFamily(et.ops.probe, et.probe, et.slots, backend=TORCH, sites=sites,
                      max_len=L, model_dtype=torch.float32, bank=bank)
    weights = [w(0), w(1)]
    spec = normalise(parse_spec({"probe": [{"site": SITE, "weights": weights,
                                            "bias": [0.0, 2.0], "positions": "all"}]}), SHAPE)
    fam.add_request(1, "a", 4, spec)
    et.slots.apply()
    fam.apply_staged_writes()
    router = TokenRouter(et.ops)
    batch = SimpleNamespace(
        req_ids=["a"], num_reqs=1, num_tokens=4, num_tokens_after_padding=6,
        query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
        query_start_loc_np=np.array([0, 4], dtype=np.int32),
        idx_mapping=torch.tensor([1]), idx_mapping_np=np.array([1]),
        num_computed_tokens_np=np.array([0]), num_scheduled_tokens=np.array([4]),
        positions=torch.tensor([0, 1, 2, 3, 0, 0]))
    plan = fam.plan(batch)
    assert plan
    router.route(batch)
    fam.route(batch, router, plan)
    x = torch.randn(6, H)
    probe_reference(et.ops.probe, et.ops.steer.bank, et.ops.tok_slot, x, None,
                    batch.positions, 1)
    step = fam.snapshot()
    step.to_cpu_nonblocking()
    out = unpack(step.per_request()["a"])  # the split's packs (courier/pack.py)
    want = x[:4] @ torch.tensor([weights[0], weights[1]]).T + torch.tensor([0.0, 2.0])
    torch.testing.assert_close(out[f"probe:{SITE}"], want, atol=1e-5, rtol=1e-5)
    assert out[f"probe:{SITE}@positions"].tolist() == [0, 1, 2, 3]
    assert fam.stats()["requests"] == 1 and bank.held() == 2
    # Through the step set, as vLLM hands it the step's output: the request's rows are
    # held while its sampled token cannot finish it, and come home in one chunk when
    # one can (here its stop token), HELD saying how many positions ran.
    from graphtap.courier import StepSnapshots
    from graphtap.courier.chunks import HELD
    from graphtap.courier.held import Ending, StepBatch

    fam.hold("a", Ending(frozenset({7}), cap=L, every_step=False))
    sampled = lambda tok: SimpleNamespace(req_ids=["a"], sampled_token_ids=[[tok]])  # noqa
    for tok, comes in ((3, False), (7, True)):
        step = fam.snapshot()
        step.to_cpu_nonblocking()
        got = StepSnapshots([step], batch=StepBatch(["a"], np.array([4]))).chunks(
            sampled(tok))
        assert ("a" in got) == comes
    rows = got["a"][f"probe:{SITE}"]
    assert rows.shape == (8, 2) and got["a"][HELD].tolist() == [4]  # both steps' rows
    for twice in (rows[0::2], rows[1::2]):  # the same positions twice, in position order
        torch.testing.assert_close(twice, want, atol=1e-5, rtol=1e-5)
    assert fam.stats()["held_requests"] == 1 and fam.stats()["held_bytes"] == 0
    fam.remove_request("a")
    assert bank.held() == 0 and fam.stats() == {
        "requests": 0, "active_slots": 0, "held_requests": 0, "held_bytes": 0,
        "ring_requests": 0, "ring_steps_total": 0, "ring_reads_total": 0, "ring_fetches_total": 0,
        "ring_read_ms_total": 0.0}
    et.slots.apply()
    assert (et.ops.probe.entry_vec[1] == 0).all()
