"""Steering and capture parity against HF transformers, on each tiny model in eager and
torch.compile mode: one graphtap engine at a time (the module's fixture is parametrised
over the four engines, so each test runs against each)."""
import pytest
import torch

from graphtap.testing.engines import _hf_model, tokenize
from graphtap.testing.hf_reference import hf_generate
from helpers import MAX_TOKENS, assert_parity, run, vector

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
                   hook_config={"sites": ENGINE_SITES})
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
    from graphtap.testing.hf_reference import hf_capture

    llm, path, hidden, layers = steer_engine
    ids = tokenize(path, [PROMPT])[0]
    sites = [f"blocks.{l}.hook_resid_{k}" for l in (0, layers - 1) for k in ("pre", "mid", "post")]
    steer = {"steer": [{"site": "blocks.1.hook_resid_post", "op": "add", "scale": 3.0,
                        "vector": vector(hidden, 4)}]}
    hooks = {"capture": [{"site": s, "dtype": "float32"} for s in sites], **steer}
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, hooks=hooks),
                       use_tqdm=False)[0]
    want, wpos, tokens = hf_capture(_hf_model(str(path)), ids, MAX_TOKENS, sites, steer)
    assert list(out.outputs[0].token_ids) == tokens
    for s in sites:
        assert out.hooks.positions[s].tolist() == wpos[s].tolist(), s
        assert (out.hooks[s] - want[s]).abs().max().item() <= 1e-4, s



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
    for k, cap in zip("qkvz", caps):
        site = cap["site"]
        ref = want[k][:, sorted(cap["heads"])] if cap.get("heads") else want[k]
        assert out.hooks.positions[site].tolist() == positions.tolist(), site
        assert out.hooks[site].shape == ref.shape, (site, out.hooks[site].shape, ref.shape)
        assert (out.hooks[site] - ref).abs().max().item() <= 1e-4, site
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
