"""A capture too large for the buffer yields the documented error; others are unharmed."""
import pytest
import torch

from graphtap.testing.engines import make_llm, shutdown, tokenize


@pytest.fixture(scope="module")
def engine(llama_path):
    sites = ["blocks.*.hook_resid_pre", "blocks.*.hook_resid_mid", "blocks.*.hook_resid_post",
             "blocks.0.attn.hook_pattern"]
    llm = make_llm(llama_path, hook_manager="graphtap",
                   hook_config={"capture_rows": 16, "pattern_rows": 8, "sites": sites})
    yield llm
    shutdown(llm)


def test_overflow_is_an_error_not_silent_loss(engine, llama_path):
    from vllm import SamplingParams

    big, plain, small = tokenize(llama_path, ["Interpretability engineers read the residual",
                                              "The quick brown fox", "Numbers like 12, 40"])
    sites = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_mid", "blocks.2.hook_resid_post"]
    too_big = {"capture": [{"site": s} for s in sites]}  # 3 rows per prompt token > 16
    p = lambda h=None: SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, hooks=h)
    reference = engine.generate([{"prompt_token_ids": plain}], p(), use_tqdm=False)[0]
    outs = engine.generate([{"prompt_token_ids": big}, {"prompt_token_ids": plain}],
                           [p(too_big), p()], use_tqdm=False)
    assert outs[0].hooks.error and "hook_config.capture_rows" in outs[0].hooks.error
    assert dict(outs[0].hooks) == {}
    assert list(outs[1].outputs[0].token_ids) == list(reference.outputs[0].token_ids)
    assert len(outs[0].outputs[0].token_ids) == 6  # the request itself still completes
    fits = {"capture": [{"site": "blocks.2.hook_resid_post", "positions": "last_prompt"}]}
    ok = engine.generate([{"prompt_token_ids": small}], p(fits), use_tqdm=False)[0]
    assert ok.hooks.error is None and ok.hooks.positions["blocks.2.hook_resid_post"].tolist() \
        == [len(small) - 1]


def test_pattern_overflow_is_an_error_too(engine, llama_path):
    from vllm import SamplingParams

    prompt, plain = tokenize(llama_path, ["Interpretability engineers read", "The quick brown fox"])
    p = lambda h=None: SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, hooks=h)
    reference = engine.generate([{"prompt_token_ids": plain}], p(), use_tqdm=False)[0]
    too_big = {"capture": [{"site": "blocks.0.attn.hook_pattern"}]}  # 4 heads x prompt > 8
    fits = {"capture": [{"site": "blocks.0.attn.hook_pattern", "heads": [1],
                         "positions": "last_prompt"}]}
    outs = engine.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": plain}],
                           [p(too_big), p(fits)], use_tqdm=False)
    assert outs[0].hooks.error and "hook_config.pattern_rows" in outs[0].hooks.error
    assert len(outs[0].outputs[0].token_ids) == 4
    assert list(outs[1].outputs[0].token_ids) == list(reference.outputs[0].token_ids)
    alone = engine.generate([{"prompt_token_ids": plain}], p(fits), use_tqdm=False)[0]
    assert alone.hooks.error is None
    assert alone.hooks["blocks.0.attn.hook_pattern"].shape == (1, 1, len(plain))
    # Its neighbour overflowed the step; its own rows fitted: it gets them (issue 16,
    # item 5: they were withheld with the neighbour's), the same as alone.
    assert outs[1].hooks.error is None
    assert torch.equal(outs[1].hooks["blocks.0.attn.hook_pattern"],
                       alone.hooks["blocks.0.attn.hook_pattern"])
