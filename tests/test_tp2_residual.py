"""Tensor parallelism, first part of issue 19: residual steering, captures and probes at
TP=2 on vLLM's CPU build (two worker processes bound one core each), one engine at a
time, eager and torch.compile: greedy tokens and logprobs equal HF with the same
steering, every captured residual row comes back once (rows from one rank: the stream is
replicated after the all-reduce), equal to HF's, and probe scores (the device ring
included) equal the probe of the captured rows. Attention sites at TP > 1 stay refused
at engine start until the courier gathers heads across ranks."""
import os

import pytest

from graphtap.testing.engines import _hf_model, tokenize
from graphtap.testing.hf_reference import hf_generate
from helpers import MAX_TOKENS, assert_captures_equal_hf, assert_parity, run, vector

PROMPT = "Steering vectors shift the hidden state"
BIND = "VLLM_CPU_OMP_THREADS_BIND"


@pytest.fixture(scope="module", params=[True, False], ids=["eager", "compiled"])
def tp2(llama_path, request):
    from transformers import AutoConfig

    from graphtap.testing.engines import make_llm, shutdown

    # Without it the CPU build refuses TP=2 here ("Not enough allowed NUMA nodes");
    # the worker processes inherit it. Restored after: other modules run TP=1.
    before = os.environ.get(BIND)
    os.environ[BIND] = "0|1"
    try:
        cfg = AutoConfig.from_pretrained(llama_path)
        llm = make_llm(llama_path, eager=request.param, hook_manager="graphtap",
                       tensor_parallel_size=2,
                       hook_config={"sites": ["blocks.*.hook_resid_post",
                                              "blocks.1.hook_resid_mid"], "probe_ring": 16})
        yield llm, llama_path, cfg.hidden_size, cfg.num_hidden_layers
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
