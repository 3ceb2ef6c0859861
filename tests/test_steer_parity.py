"""Steering and capture parity against HF transformers, on each tiny model in eager and
torch.compile mode: one graphtap engine at a time (the module's fixture is parametrised
over the four engines, so each test runs against each)."""
import numpy as np
import pytest
import torch

from graphtap.testing.engines import _hf_model, tokenize
from graphtap.testing.hf_reference import hf_generate
from helpers import (MAX_TOKENS, assert_captures_equal_hf, assert_head_captures_equal_hf,
                     assert_parity, run, vector)

OPS = [dict(op="add", scale=6.0), dict(op="set_projection", target=4.0), dict(op="ablate"),
       dict(op="clamp", min=-0.25, max=0.25)]
KINDS = ["resid_pre", "resid_mid", "resid_post"]
PROMPT = "Steering vectors shift the hidden state"
ATTN_LAYER = 1
ENGINE_SITES = ["blocks.*.hook_resid_pre", "blocks.*.hook_resid_mid", "blocks.*.hook_resid_post",
                *(f"blocks.{ATTN_LAYER}.attn.hook_{k}" for k in ("q", "k", "v", "z", "pattern"))]
ENGINES = [("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False)]


@pytest.fixture(scope="module", params=ENGINES,
                ids=lambda e: f"{e[0]}-{'eager' if e[1] else 'compiled'}")
def steer_engine(request):
    """One graphtap engine at a time: (llm, model path, hidden size, layers)."""
    from transformers import AutoConfig

    from graphtap.testing.engines import make_llm, shutdown

    model, eager = request.param
    path = request.getfixturevalue(f"{model}_path")
    cfg = AutoConfig.from_pretrained(path)
    llm = make_llm(path, eager=eager, hook_manager="graphtap",
                   # a small probe ring: decoding probes read it several times a request
                   hook_config={"sites": ENGINE_SITES, "probe_ring": 16})
    yield llm, path, cfg.hidden_size, cfg.num_hidden_layers
    shutdown(llm)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o["op"])
def test_steer_parity_with_hf(steer_engine, kind, op):
    llm, path, hidden, layers = steer_engine
    ids = tokenize(path, [PROMPT])[0]
    layer = 0 if kind == "resid_pre" else layers // 2
    hooks = {"steer": [{"site": f"blocks.{layer}.hook_{kind}", "vector": vector(hidden),
                        "positions": "all", **op}]}
    got = run(llm, ids, hooks)
    assert_parity(got, hf_generate(_hf_model(str(path)), ids, MAX_TOKENS, hooks))
    if op["op"] == "add":  # the steer must matter, or parity proves nothing
        assert got[0] != run(llm, ids)[0]


@pytest.mark.parametrize("positions", ["prompt", "generated", "last_prompt", [2, 5, 9],
                                       {"start": 3, "end": 11}], ids=str)
def test_positions_and_several_steers_parity_with_hf(steer_engine, positions):
    llm, path, hidden, layers = steer_engine
    ids = tokenize(path, [PROMPT])[0]
    hooks = {"steer": [
        {"site": f"blocks.{layers - 1}.hook_resid_post", "op": "add", "scale": 5.0,
         "vector": vector(hidden, 1), "positions": positions},
        {"site": "blocks.1.hook_resid_mid", "op": "set_projection", "target": -3.0,
         "vector": vector(hidden, 2), "positions": positions},
        {"site": f"blocks.{layers - 1}.hook_resid_post", "op": "clamp", "min": -0.1,
         "max": 0.1, "vector": vector(hidden, 3), "positions": "all"},
    ]}
    assert_parity(run(llm, ids, hooks), hf_generate(_hf_model(str(path)), ids, MAX_TOKENS, hooks))


def test_plain_requests_match_hf(steer_engine):
    llm, path, _, _ = steer_engine
    ids = tokenize(path, [PROMPT])[0]
    assert_parity(run(llm, ids), hf_generate(_hf_model(str(path)), ids, MAX_TOKENS))


def test_runner_is_v2(steer_engine):
    from graphtap.testing.engines import runner_info

    assert runner_info(steer_engine[0])["model_runner_v2"]


def test_capture_parity_with_hf(steer_engine):
    """Capture at every residual kind, steered too: the ops survive torch.compile."""
    llm, path, hidden, layers = steer_engine
    sites = [f"blocks.{l}.hook_resid_{k}" for l in (0, layers - 1) for k in ("pre", "mid", "post")]
    steer = {"steer": [{"site": "blocks.1.hook_resid_post", "op": "add", "scale": 3.0,
                        "vector": vector(hidden, 4)}]}
    assert_captures_equal_hf(llm, path, tokenize(path, [PROMPT])[0], sites, steer)


def test_attention_capture_parity_with_hf(steer_engine):
    """Post-RoPE q and k, v and z with head selection (GQA on Qwen2) against HF."""
    from vllm import SamplingParams

    from graphtap.testing.hf_reference import hf_capture_attention

    llm, path, _, _ = steer_engine
    ids = tokenize(path, [PROMPT])[0]
    caps = [{"site": f"blocks.{ATTN_LAYER}.attn.hook_{k}", "dtype": "float32"} for k in "qkvz"]
    # q: heads come back in ascending order (adjacent 2, 3 copied as one slice), v: one head
    caps[0]["heads"], caps[2]["heads"] = [3, 0, 2], [0]
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                      hooks={"capture": caps}), use_tqdm=False)[0]
    want, positions = hf_capture_attention(_hf_model(str(path)), ids, MAX_TOKENS, ATTN_LAYER)
    assert_head_captures_equal_hf(out, want, positions, caps)
    # Alone in its steps, a request reading k head 1 and v head 0 has only the first two
    # heads' columns of each row cloned and copied home (CaptureFamily.columns).
    narrow = [{"site": f"blocks.{ATTN_LAYER}.attn.hook_{k}", "dtype": "float32",
               "heads": [h]} for k, h in (("k", 1), ("v", 0))]
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                      hooks={"capture": narrow}), use_tqdm=False)[0]
    for cap, k in zip(narrow, "kv"):
        ref = want[k][:, cap["heads"]]
        assert out.hooks[cap["site"]].shape == ref.shape, cap
        assert (out.hooks[cap["site"]] - ref).abs().max().item() <= 1e-4, cap


def test_attention_pattern_parity_with_hf(steer_engine):
    """Attention probabilities from q and the paged K cache (GQA on Qwen2) against HF's
    eager attention over the whole sequence, prompt and generated positions."""
    from vllm import SamplingParams

    from graphtap.testing.hf_reference import hf_attention_pattern

    llm, path, _, _ = steer_engine
    ids = tokenize(path, [PROMPT])[0]
    site = f"blocks.{ATTN_LAYER}.attn.hook_pattern"
    caps = [{"site": site, "dtype": "float32", "heads": [0, 3]}]
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                      hooks={"capture": caps}), use_tqdm=False)[0]
    ran = ids + list(out.outputs[0].token_ids)[:-1]  # the last sampled token never runs
    want = hf_attention_pattern(_hf_model(str(path)), ran, ATTN_LAYER)[:, [0, 3]]
    assert out.hooks.positions[site].tolist() == list(range(len(ran)))
    assert out.hooks[site].shape == want.shape, (out.hooks[site].shape, want.shape)
    assert (out.hooks[site] - want).abs().max().item() <= 1e-4
    torch.testing.assert_close(out.hooks[site].sum(-1), torch.ones(len(ran), 2))


HEAD_STEERS = {
    "ablate-heads": [dict(op="scale", heads=[0, 2], scale=0.0)],
    "scale-head": [dict(op="scale", heads=[1], scale=3.0, positions="prompt")],
    "add-per-head": [dict(op="add", heads=[1, 3], scale=2.0, vector="head")],
    "add-row-then-scale": [dict(op="add", scale=1.5, vector="row"),
                           dict(op="scale", heads=[3], scale=-0.5, positions="generated")],
}


@pytest.mark.parametrize("case", HEAD_STEERS, ids=str)
def test_head_steering_parity_with_hf(steer_engine, case):
    """Head interventions at attn.hook_z equal HF with the same edit of o_proj's input,
    and what is captured at z is the edited value (steer first, then capture)."""
    from transformers import AutoConfig
    from vllm import SamplingParams

    llm, path, hidden, layers = steer_engine
    cfg = AutoConfig.from_pretrained(path)
    heads, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    ids = tokenize(path, [PROMPT])[0]
    site = f"blocks.{ATTN_LAYER}.attn.hook_z"
    steers = []
    for i, s in enumerate(HEAD_STEERS[case]):
        width = {"head": d, "row": heads * d}.get(s.get("vector"))
        steers.append({**s, "site": site, **({"vector": vector(width, 5 + i)} if width else {})})
    hooks = {"steer": steers}
    got = run(llm, ids, hooks)
    assert_parity(got, hf_generate(_hf_model(str(path)), ids, MAX_TOKENS, hooks))
    assert got[1] != run(llm, ids)[1], "the edit should matter (logprobs at least)"
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, hooks={
                           **hooks, "capture": [{"site": site, "dtype": "float32"}]}),
                       use_tqdm=False)[0]
    z = out.hooks[site]
    if case == "ablate-heads":  # exactly zero, every position
        assert z[:, [0, 2]].abs().max().item() == 0.0 and z[:, 1].abs().max().item() > 0


@pytest.mark.parametrize("positions", ["all", "last_prompt"])
def test_probe_scores_equal_hf(steer_engine, positions):
    """Probe scores computed on the device equal act(resid @ W.T + b) of the residual the
    same request captured (1e-5 relative: the op), and of HF's residual stream, steered
    at the same site first as the probe sees it (as close as captures are to HF)."""
    from vllm import SamplingParams

    from graphtap.testing.hf_reference import hf_capture

    llm, path, hidden, layers = steer_engine
    ids = tokenize(path, [PROMPT])[0]
    site, other = f"blocks.{layers - 1}.hook_resid_post", "blocks.1.hook_resid_mid"
    weights = [vector(hidden, 20 + i) for i in range(3)]
    steer = {"steer": [{"site": site, "op": "add", "scale": 2.0, "vector": vector(hidden, 9)}]}
    hooks = {**steer, "probe": [
        {"site": site, "weights": weights, "bias": [0.5, -0.25, 0.0], "positions": positions},
        {"site": other, "weights": weights[:1], "activation": "sigmoid",
         "positions": positions}],
        "capture": [{"site": site, "dtype": "float32", "positions": positions},
                    {"site": other, "dtype": "float32", "positions": positions}]}
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, hooks=hooks),
                       use_tqdm=False)[0]
    want, wpos, _ = hf_capture(_hf_model(str(path)), ids, MAX_TOKENS, [site, other], steer)
    w = torch.tensor(weights)
    for name, ref in [(site, want[site] @ w.T + torch.tensor([0.5, -0.25, 0.0])),
                      (other, torch.sigmoid(want[other] @ w[:1].T))]:
        keep = wpos[name] == len(ids) - 1 if positions == "last_prompt" else \
            torch.ones(len(wpos[name]), dtype=torch.bool)
        got = out.hooks[f"probe:{name}"]
        assert out.hooks.positions[f"probe:{name}"].tolist() == wpos[name][keep].tolist()
        own = out.hooks[name] @ w[:got.shape[1]].T
        own = torch.sigmoid(own) if name == other else own + torch.tensor([0.5, -0.25, 0.0])
        torch.testing.assert_close(got, own, rtol=1e-5, atol=1e-5 * own.abs().max().item())
        assert (got - ref[keep]).abs().max().item() <= 1e-4 * max(ref.abs().max().item(), 1)


def test_attention_mass_equals_span_sums_of_hf_attention(steer_engine):
    """Attention mass on key spans (two spans: the Attention Tracker's case; four: the
    re-ranker's), computed on the device, equals the span sums of HF's eager attention
    at every position, and the focus score from it equals the analyzer's on HF's pattern."""
    from vllm import SamplingParams

    from graphtap.analyzers import focus_score, span_mass
    from graphtap.testing.hf_reference import hf_attention_pattern

    llm, path, _, _ = steer_engine
    ids = tokenize(path, [PROMPT])[0]
    site = f"blocks.{ATTN_LAYER}.attn.hook_pattern"
    two = [(0, 3), (3, len(ids))]
    four = [(0, 2), (2, 4), (4, 6), (6, 60)]
    hooks = {"attention_mass": [{"site": site, "heads": [1, 2], "positions": "all",
                                 "spans": [{"start": s, "end": e} for s, e in two + four]}]}
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                      hooks=hooks), use_tqdm=False)[0]
    ran = ids + list(out.outputs[0].token_ids)[:-1]
    pattern = hf_attention_pattern(_hf_model(str(path)), ran, ATTN_LAYER)[:, [1, 2]]
    want = span_mass(pattern, two + four)
    got = out.hooks[f"mass:{site}"]
    assert out.hooks.positions[f"mass:{site}"].tolist() == list(range(len(ran)))
    assert got.shape == (len(ran), 2, 6)
    assert (got - want).abs().max().item() <= 1e-5
    last = len(ids) - 1
    focus = (got[last, :, 0] / (got[last, :, 0] + got[last, :, 1])).mean().item()
    assert focus == pytest.approx(focus_score(pattern[last], *two), abs=1e-5)


def test_guards_stop_exactly_the_flagged_requests(steer_engine):
    """In one batch: a probe guard that flags the first generated token and a focus guard
    that flags the prompt stop with finish_reason "guard" (after that step's token); a
    focus guard that flags but only annotates runs on; a probe guard that never flags
    and a plain request equal their runs without guards, logprobs included."""
    from vllm import SamplingParams

    llm, path, hidden, layers = steer_engine
    ids = tokenize(path, [PROMPT])[0]
    site = f"blocks.{layers - 1}.hook_resid_post"
    probe = {"site": site, "weights": [vector(hidden, 30)], "positions": "generated"}
    mass = {"site": f"blocks.{ATTN_LAYER}.attn.hook_pattern",
            "spans": [{"start": 0, "end": 3}, {"start": 3, "end": len(ids)}]}
    specs = {
        "probe-stop": {"probe": [probe], "guard": {"kind": "probe", "threshold": -1e30,
                                                   "action": "stop"}},
        "probe-quiet": {"probe": [probe], "guard": {"kind": "probe", "threshold": 1e30,
                                                    "action": "stop"}},
        "focus-stop": {"attention_mass": [mass], "guard": {"kind": "attention_focus",
                                                           "threshold": 2.0, "action": "stop"}},
        "focus-note": {"attention_mass": [mass], "guard": {"kind": "attention_focus",
                                                           "threshold": 2.0}},
        "plain": None}
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True,
                             hooks=h) for h in specs.values()]
    outs = dict(zip(specs, llm.generate([{"prompt_token_ids": ids}] * len(specs), params,
                                        use_tqdm=False)))
    assert outs["probe-stop"].outputs[0].finish_reason == "guard"
    assert len(outs["probe-stop"].outputs[0].token_ids) == 2  # flagged at the first one run
    assert outs["probe-stop"].hooks.guard["position"] == len(ids)
    assert outs["focus-stop"].outputs[0].finish_reason == "guard"
    assert len(outs["focus-stop"].outputs[0].token_ids) == 1  # right after prefill
    focus = outs["focus-stop"].hooks.guard
    assert focus["flagged"] and focus["position"] == len(ids) - 1 and 0 <= focus["score"] <= 1
    note = outs["focus-note"]
    assert note.outputs[0].finish_reason == "length" and note.hooks.guard["flagged"]
    assert note.hooks.guard["score"] == pytest.approx(focus["score"])
    plain = run(llm, ids, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name in ("probe-quiet", "plain"):
        o = outs[name].outputs[0]
        tokens = list(o.token_ids)
        assert o.finish_reason == "length", name
        assert_parity((tokens, [lp[t].logprob for lp, t in zip(o.logprobs, tokens)]), plain)
    assert not outs["probe-quiet"].hooks.guard["flagged"]


def test_rerank_orders_documents_as_the_hf_reference(steer_engine):
    """In-context re-ranking from the device's attention mass (real and content-free
    query batched together) gives HF's order and scores, computed from its eager
    attention on the same two prompts."""
    from graphtap.analyzers import span_mass
    from graphtap.rerank import CONTENT_FREE, layout, rerank
    from graphtap.testing.hf_reference import hf_attention_pattern

    llm, path, _, _ = steer_engine
    docs = ["The fox jumps over the dog.", "Numbers like 12, 40", "Attention patterns",
            "Steering vectors shift the hidden state"]
    query = "which tokens shift"
    got = rerank(llm, query, docs, [ATTN_LAYER])
    tok = llm.get_tokenizer()
    hf = _hf_model(str(path))
    want = []
    for q in (query, CONTENT_FREE):
        ids, spans, (q0, q1) = layout(tok, docs, q)
        pattern = hf_attention_pattern(hf, ids, ATTN_LAYER)[q0:q1]  # [queries, heads, keys]
        want.append(span_mass(pattern, spans).mean((0, 1)))
    want = (want[0] - want[1]).numpy()
    assert [i for i, _ in got] == list(np.argsort(-want, kind="stable"))
    assert np.abs(np.array([s for _, s in sorted(got)]) - want).max() <= 1e-5


def test_conditional_steering_gated_on_equals_hf_and_gated_off_is_plain(steer_engine):
    """CAST-style: steer the generation only when the prompt's residual at layer 1
    projects past a threshold on a condition vector, decided on the device. The
    threshold splits two prompts (midway between their HF projections); in one batch the
    prompt whose gate opens equals HF with the same conditional hook, and the one whose
    gate stays shut is bit-identical (tokens and logprobs) to the same batch unsteered.
    "below" flips which one is steered."""
    from vllm import SamplingParams

    from graphtap.testing.hf_reference import hf_capture

    llm, path, hidden, layers = steer_engine
    prompts = tokenize(path, [PROMPT, "Numbers like 12, 40 and 7 are small"])
    cond_site = "blocks.1.hook_resid_post"
    c = np.array(vector(hidden, 41))
    hf = _hf_model(str(path))
    proj = []
    for ids in prompts:
        rows, pos, _ = hf_capture(hf, ids, 1, [cond_site])
        last = rows[cond_site][(pos[cond_site] == len(ids) - 1).nonzero()[0, 0]].numpy()
        proj.append(float(last @ c / np.linalg.norm(c)))
    assert abs(proj[0] - proj[1]) > 1e-3
    threshold = (proj[0] + proj[1]) / 2
    high = int(np.argmax(proj))

    def spec(compare):
        return {"steer": [{"site": f"blocks.{layers - 1}.hook_resid_post", "op": "add",
                           "scale": 6.0, "vector": vector(hidden, 42), "positions": "generated",
                           "condition": {"site": cond_site, "vector": c.tolist(),
                                         "threshold": threshold, "compare": compare}}]}

    def batch(hooks):
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
                                 hooks=h) for h in hooks]
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params,
                            use_tqdm=False)
        return [(list(o.outputs[0].token_ids),
                 [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outs]

    for compare, on in (("above", high), ("below", 1 - high)):
        off = 1 - on
        gated = batch([spec(compare)] * 2)
        mixed = [None, None]
        mixed[on] = spec(compare)
        reference = batch(mixed)  # the same batch with the gated-off request plain
        assert gated[off] == reference[off], "a shut gate must leave the request as it was"
        assert gated[on] == reference[on]
        want = hf_generate(hf, prompts[on], MAX_TOKENS, spec(compare))
        assert_parity(gated[on], want)
        plain = hf_generate(hf, prompts[on], MAX_TOKENS)
        assert gated[on][0] != plain[0], "the open gate's steer should matter"
