"""Tensor parallelism (issue 19) at TP=2 on vLLM's CPU build (two worker processes bound
one core each), on the Qwen2 tiny model (4 query heads over 2 KV heads: each rank holds
2 query heads and 1 KV head), one engine at a time, eager and torch.compile: greedy
tokens and logprobs equal HF with the same residual steering; every captured residual
row comes back once (the stream is whole on every rank; one writes it), equal to HF's;
probe scores (the device ring included) equal the probe of the captured rows; and every
per-head site (q, k, v, z with chosen heads, attention patterns, attention mass, head
steering at z) equals HF over the whole head set, in TP=1's head order: each rank
writes its heads and the step's rows are summed over the ranks (engine/heads.py)."""
import os

import pytest

from graphtap.testing.engines import _hf_model, tokenize
from graphtap.testing.hf_reference import hf_generate
from helpers import (MAX_TOKENS, assert_captures_equal_hf, assert_head_captures_equal_hf,
                     assert_parity, run, vector)

PROMPT = "Steering vectors shift the hidden state"
BIND = "VLLM_CPU_OMP_THREADS_BIND"
ATTN = 1  # the layer whose attention sites are configured
ATTN_SITES = [f"blocks.{ATTN}.attn.hook_{k}" for k in ("q", "k", "v", "z", "pattern")]


@pytest.fixture(scope="module", params=[True, False], ids=["eager", "compiled"])
def tp2(qwen2_path, request):
    from transformers import AutoConfig

    from graphtap.testing.engines import make_llm, shutdown

    # Without it the CPU build refuses TP=2 here ("Not enough allowed NUMA nodes");
    # the worker processes inherit it. Restored after: other modules run TP=1.
    before = os.environ.get(BIND)
    os.environ[BIND] = "0|1"
    try:
        cfg = AutoConfig.from_pretrained(qwen2_path)
        llm = make_llm(qwen2_path, eager=request.param, hook_manager="graphtap",
                       tensor_parallel_size=2,
                       hook_config={"sites": ["blocks.*.hook_resid_post",
                                              "blocks.1.hook_resid_mid", *ATTN_SITES],
                                    "probe_ring": 16})
        yield llm, qwen2_path, cfg.hidden_size, cfg.num_hidden_layers
        shutdown(llm)
    finally:
        if before is None:
            os.environ.pop(BIND, None)
        else:
            os.environ[BIND] = before


def test_steering_at_tp2_equals_hf(tp2):
    llm, path, hidden, layers = tp2
    ids = tokenize(path, [PROMPT])[0]
    hooks = {"steer": [{"site": f"blocks.{layers // 2}.hook_resid_post", "op": "add",
                        "scale": 6.0, "vector": vector(hidden, 1)},
                       {"site": "blocks.1.hook_resid_mid", "op": "set_projection",
                        "target": -3.0, "vector": vector(hidden, 2), "positions": "generated"}]}
    got = run(llm, ids, hooks)
    assert_parity(got, hf_generate(_hf_model(str(path)), ids, MAX_TOKENS, hooks))
    assert got[0] != run(llm, ids)[0]


def test_residual_captures_at_tp2_come_back_once_and_equal_hf(tp2):
    llm, path, hidden, layers = tp2
    steer = {"steer": [{"site": "blocks.0.hook_resid_post", "op": "add", "scale": 3.0,
                        "vector": vector(hidden, 4)}]}
    assert_captures_equal_hf(llm, path, tokenize(path, [PROMPT])[0],  # positions: once each
                             ["blocks.1.hook_resid_mid", f"blocks.{layers - 1}.hook_resid_post"],
                             steer)


def test_probe_scores_at_tp2_equal_the_probe_of_the_captured_rows(tp2):
    """Every position's score once (the prompt's routed, the generated ones through the
    device ring of rank 0), each the probe of the same request's captured residual."""
    import torch
    from vllm import SamplingParams

    llm, path, hidden, layers = tp2
    ids = tokenize(path, [PROMPT])[0]
    site = f"blocks.{layers - 1}.hook_resid_post"
    w = vector(hidden, 7)
    hooks = {"probe": [{"site": site, "weights": [w], "bias": [0.5]}],
             "capture": [{"site": site, "dtype": "float32"}]}
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                      hooks=hooks), use_tqdm=False)[0]
    assert out.hooks.error is None
    ran = len(ids) + MAX_TOKENS - 1
    assert out.hooks.positions[f"probe:{site}"].tolist() == list(range(ran))
    own = out.hooks[site] @ torch.tensor(w) + 0.5
    torch.testing.assert_close(out.hooks[f"probe:{site}"][:, 0], own, rtol=1e-5,
                               atol=1e-5 * own.abs().max().item())


def generate(llm, ids, hooks, ignore_eos=False):
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                      ignore_eos=ignore_eos, hooks=hooks), use_tqdm=False)[0]
    assert out.hooks.error is None, out.hooks.error
    return out


def test_head_captures_at_tp2_equal_hf_in_tp1_order(tp2):
    """q, k, v and z rows hold every head, each rank's in its TP=1 place: chosen heads
    from both ranks (q 3, 0, 2; k 1, which only rank 1 holds), in a step that also
    captures a residual row (written by rank 0 alone, summed with rank 1's zeros)."""
    from graphtap.testing.hf_reference import hf_capture, hf_capture_attention

    llm, path, hidden, layers = tp2
    ids = tokenize(path, [PROMPT])[0]
    caps = [{"site": f"blocks.{ATTN}.attn.hook_{k}", "dtype": "float32"} for k in "qkvz"]
    caps[0]["heads"], caps[1]["heads"] = [3, 0, 2], [1]
    resid = f"blocks.{layers - 1}.hook_resid_post"
    out = generate(llm, ids, {"capture": caps + [{"site": resid, "dtype": "float32"}]})
    hf = _hf_model(str(path))
    want, positions = hf_capture_attention(hf, ids, MAX_TOKENS, ATTN)
    assert_head_captures_equal_hf(out, want, positions, caps)
    rows, wpos, _ = hf_capture(hf, ids, MAX_TOKENS, [resid], {})
    assert out.hooks.positions[resid].tolist() == wpos[resid].tolist()
    assert (out.hooks[resid] - rows[resid]).abs().max().item() <= 1e-4


def test_patterns_and_attention_mass_at_tp2_equal_hf(tp2):
    """Each rank computes its heads' probabilities from its q and its K cache: heads 0
    (rank 0) and 3 (rank 1) of the pattern, the mass of heads 1 and 2 on two spans."""
    from graphtap.analyzers import span_mass
    from graphtap.testing.hf_reference import hf_attention_pattern

    llm, path, _, _ = tp2
    ids = tokenize(path, [PROMPT])[0]
    site = f"blocks.{ATTN}.attn.hook_pattern"
    spans = [(0, 3), (3, len(ids))]
    out = generate(llm, ids, {
        "capture": [{"site": site, "dtype": "float32", "heads": [0, 3]}],
        "attention_mass": [{"site": site, "heads": [1, 2], "positions": "all",
                            "spans": [{"start": s, "end": e} for s, e in spans]}]},
                   ignore_eos=True)
    ran = ids + list(out.outputs[0].token_ids)[:-1]  # the last sampled token never runs
    pattern = hf_attention_pattern(_hf_model(str(path)), ran, ATTN)
    assert out.hooks.positions[site].tolist() == list(range(len(ran)))
    assert out.hooks[site].shape == pattern[:, [0, 3]].shape
    assert (out.hooks[site] - pattern[:, [0, 3]]).abs().max().item() <= 1e-4
    mass = out.hooks[f"mass:{site}"]
    assert mass.shape == (len(ran), 2, 2)
    assert (mass - span_mass(pattern[:, [1, 2]], spans)).abs().max().item() <= 1e-5


def test_head_steering_at_tp2_equals_hf(tp2):
    """Heads 0 and 2 ablated (one on each rank) and a head_dim vector added to heads 1
    and 3: tokens and logprobs equal HF with the same edit of o_proj's input, and z
    captured after it is zero exactly at the ablated heads."""
    from transformers import AutoConfig

    llm, path, _, _ = tp2
    cfg = AutoConfig.from_pretrained(path)
    d = cfg.hidden_size // cfg.num_attention_heads
    ids = tokenize(path, [PROMPT])[0]
    site = f"blocks.{ATTN}.attn.hook_z"
    hooks = {"steer": [{"site": site, "op": "scale", "heads": [0, 2], "scale": 0.0},
                       {"site": site, "op": "add", "heads": [1, 3], "scale": 2.0,
                        "vector": vector(d, 5)}]}
    got = run(llm, ids, hooks)
    assert_parity(got, hf_generate(_hf_model(str(path)), ids, MAX_TOKENS, hooks))
    assert got[1] != run(llm, ids)[1], "the edit should matter (logprobs at least)"
    z = generate(llm, ids, {**hooks, "capture": [{"site": site, "dtype": "float32"}]}
                 ).hooks[site]
    assert z[:, [0, 2]].abs().max().item() == 0.0 and z[:, [1, 3]].abs().min().item() > 0
