"""The patched vLLM runs Model Runner V2 on CPU and matches HF transformers token for token.

A silent fallback to the V1 runner must fail here: V1 has none of graphtap's hook slots.
"""
import pytest

from graphtap.testing.engines import hf_greedy, make_llm, runner_info, shutdown, tokenize
from conftest import PROMPTS

MAX_TOKENS = 24
CASES = [("llama", True), ("qwen2", True), ("llama", False)]  # (model, enforce_eager)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{'eager' if c[1] else 'compiled'}")
def engine(request, llama_path, qwen2_path):
    name, eager = request.param
    path = {"llama": llama_path, "qwen2": qwen2_path}[name]
    llm = make_llm(path, eager=eager)
    yield name, path, eager, llm
    shutdown(llm)


def test_uses_model_runner_v2(engine):
    _, _, eager, llm = engine
    info = runner_info(llm)
    assert info["model_runner_v2"], f"vLLM fell back to a V1 runner: {info}"
    assert info["runner_class"].startswith("vllm.v1.worker.cpu.model_runner."), info
    if not eager:
        assert info["compilation_mode"] != "NONE", f"torch.compile did not run: {info}"


def test_greedy_tokens_equal_hf(engine):
    from vllm import SamplingParams

    _, path, _, llm = engine
    prompt_ids = tokenize(path, PROMPTS)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for ids, out in zip(prompt_ids, outs):
        want = hf_greedy(path, ids, MAX_TOKENS)
        got = list(out.outputs[0].token_ids)
        assert got == want[: len(got)] and len(got) == len(want), (ids, got, want)
