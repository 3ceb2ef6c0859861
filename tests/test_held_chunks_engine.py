"""An engine that holds capturing requests' step outputs on the worker until a step that
may finish them (hook_config hold_outputs_bytes; tiny Llama, eager, one engine): every
request's rows still equal HF's, through chunked prefill, a request finishing at its
first token, a request with a stop string (never held), a long capture past the
held bytes' bound (sent early, the rest at its finish), and steps of held requests only
(kept whole, split at the finish); nothing stays held."""
import pytest

from graphtap.testing.engines import _hf_model, make_llm, shutdown, tokenize
from graphtap.testing.hf_reference import hf_capture

SITES = ["blocks.1.hook_resid_mid", "blocks.3.hook_resid_post"]
LONG = ("Interpretability engineers read the residual stream of a transformer. " * 5).strip()
BOUND = 96 << 10  # the long request's rows (2 sites x ~70 positions x 1 KiB) pass it


@pytest.fixture(scope="module")
def engine(llama_path):
    llm = make_llm(llama_path, hook_manager="graphtap", max_num_batched_tokens=48,
                   hook_config={"capture_rows": 512, "sites": SITES,
                                "hold_outputs_bytes": BOUND})
    yield llm
    shutdown(llm)


def params(max_tokens=6, **kw):
    from vllm import SamplingParams

    hooks = {"capture": [{"site": s, "positions": "all", "dtype": "float32"} for s in SITES]}
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          hooks=hooks, **kw)


def check(out, hf, ids, max_tokens):
    want, wpos, tokens = hf_capture(hf, ids, max_tokens, SITES)
    assert list(out.outputs[0].token_ids) == tokens
    assert out.hooks.error is None, out.hooks.error
    for s in SITES:
        assert out.hooks.positions[s].tolist() == wpos[s].tolist(), s
        assert (out.hooks[s].float() - want[s]).abs().max().item() <= 1e-4, s


def test_held_outputs_equal_hf(engine, llama_path):
    hf = _hf_model(str(llama_path))
    ids = tokenize(llama_path, ["The quick brown fox jumps over", LONG, "Numbers like 12, 40",
                                "Steering vectors shift"])
    plist = [params(), params(), params(max_tokens=1), params(stop=["zzzz"])]
    outs = engine.generate([{"prompt_token_ids": i} for i in ids], plist, use_tqdm=False)
    for out, i, p in zip(outs, ids, plist):
        check(out, hf, i, p.max_tokens)
    assert len(outs[1].hooks.positions[SITES[0]]) == len(ids[1]) + 5  # chunked, past the bound


def test_steps_of_held_requests_only_are_split_at_the_finish(engine, llama_path):
    """Held requests alone in the batch: their steps stay whole on the worker (unsplit,
    courier/held_chunks.py) and are split where a request goes; rows still equal HF's,
    the long one's through chunked prefill and past the bound."""
    hf = _hf_model(str(llama_path))
    (before,) = engine.collective_rpc("graphtap_hook_stats")
    ids = tokenize(llama_path, ["Numbers like 12, 40 and", LONG[:150]])
    plist = [params(max_tokens=5), params(max_tokens=3)]
    outs = engine.generate([{"prompt_token_ids": i} for i in ids], plist, use_tqdm=False)
    for out, i, p in zip(outs, ids, plist):
        check(out, hf, i, p.max_tokens)
    (after,) = engine.collective_rpc("graphtap_hook_stats")
    assert after["hold"]["steps_kept_total"] > before["hold"]["steps_kept_total"], after
    assert after["hold"]["held_steps"] == 0


def test_nothing_stays_held(engine, llama_path):
    from vllm import SamplingParams

    # finished requests leave the worker's tables with the next step's scheduler output
    engine.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2),
                    use_tqdm=False)
    (stats,) = engine.collective_rpc("graphtap_hook_stats")
    hold = stats["hold"]
    assert hold["held_chunk_requests"] == 0 and hold["held_chunk_bytes"] == 0
    # chunks were held (not all sent at once), and the long capture passed the bound
    assert hold["chunks_kept_total"] > hold["sends_total"] > 0, hold
    assert hold["bound_sends_total"] > 0, hold
