"""Mixed batches, the prefix cache and bad input, on tiny Llama (eager).

The module records a plain engine's (no hook manager) outputs first, then shuts it down
and starts the graphtap engine: the unsteered requests must match it bit for bit.
"""
import pytest

from graphtap.testing.engines import _hf_model, make_llm, shutdown, tokenize
from graphtap.testing.hf_reference import hf_generate
from helpers import assert_parity, vector

HIDDEN = 256
MIX_PROMPTS = ["The quick brown fox", "Steering vectors shift the hidden state",
               "Prompt injection asks a model to ignore", "Numbers like 12, 40"]
MIX_HOOKS = [None,
             {"steer": [{"site": "blocks.1.hook_resid_post", "op": "add", "scale": 6.0,
                         "vector": vector(HIDDEN, 5)}]},
             {"steer": [{"site": "blocks.2.hook_resid_mid", "op": "set_projection",
                         "target": -4.0, "vector": vector(HIDDEN, 6), "positions": "generated"}]},
             None]
LONG = ("Interpretability engineers read the residual stream of a transformer. " * 6).strip()
STEER = {"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "scale": 6.0,
                    "vector": vector(HIDDEN, 7)}]}
KW = dict(eager=True, block_size=32, enable_prefix_caching=True)


def params(hooks=None, max_tokens=16, **kw):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, hooks=hooks,
                          ignore_eos=True, **kw)


def result(out):
    o = out.outputs[0]
    tokens = list(o.token_ids)
    return tokens, [lp[t].logprob for lp, t in zip(o.logprobs, tokens)]


def batch(llm, ids_list, hooks_list):
    outs = llm.generate([{"prompt_token_ids": ids} for ids in ids_list],
                        [params(h) for h in hooks_list], use_tqdm=False)
    return [result(o) for o in outs]


@pytest.fixture(scope="module")
def engines(llama_path):
    mix_ids = tokenize(llama_path, MIX_PROMPTS)
    long_ids = tokenize(llama_path, [LONG, LONG.replace("engineers", "students")])
    plain = make_llm(llama_path, **KW)
    try:
        rec = {"mix": batch(plain, mix_ids, [None] * 4),
               "long": [result(plain.generate([{"prompt_token_ids": ids}], params(),
                                              use_tqdm=False)[0]) for ids in long_ids]}
        with pytest.raises(ValueError) as e:
            plain.generate([{"prompt_token_ids": mix_ids[0]}], params(STEER), use_tqdm=False)
        rec["no_manager_error"] = str(e.value)
    finally:
        shutdown(plain)
    llm = make_llm(llama_path, hook_manager="graphtap", hook_config={"max_vectors": 4}, **KW)
    yield llm, rec, mix_ids, long_ids
    shutdown(llm)


def test_hooks_without_a_manager_are_refused(engines):
    assert "needs a hook manager" in engines[1]["no_manager_error"]


def test_mixed_batch(engines, llama_path):
    llm, rec, mix_ids, _ = engines
    got = batch(llm, mix_ids, MIX_HOOKS)
    for i in (0, 3):  # unsteered: bit-identical to the plain engine, logprobs included
        assert got[i] == rec["mix"][i]
    hf = _hf_model(str(llama_path))
    for i in (1, 2):  # steered, each its own way: HF parity, and different from plain
        assert got[i][0] != rec["mix"][i][0]
        want = hf_generate(hf, mix_ids[i], 16, MIX_HOOKS[i])
        assert_parity(got[i], want)


def test_prefix_cache_never_mixes_steered_and_plain(engines):
    llm, rec, _, (ids, ids2) = engines
    one = lambda i, h=None: llm.generate([{"prompt_token_ids": i}], params(h), use_tqdm=False)[0]
    llm.reset_prefix_cache()
    steered = one(ids, STEER)
    after = one(ids, None)  # plain after steered, same prompt
    assert result(after) == rec["long"][0]
    assert not after.num_cached_tokens
    again = one(ids, STEER)  # identical steering does reuse its own blocks
    assert again.num_cached_tokens and result(again) == result(steered)
    assert result(steered)[0] != rec["long"][0][0]

    llm.reset_prefix_cache()
    cold = result(one(ids2, STEER))
    llm.reset_prefix_cache()
    first = one(ids2, None)  # plain first, then steered on the same prompt
    assert result(first) == rec["long"][1]
    warm = one(ids2, STEER)
    assert not warm.num_cached_tokens and result(warm) == cold


BAD = [
    ({"steer": [{"site": "blocks.1.hook_nope", "op": "add", "vector": [0.0] * HIDDEN}]},
     "hooks.steer[0].site"),
    ({"steer": [{"site": "blocks.7.hook_resid_post", "op": "add", "vector": [0.0] * HIDDEN}]},
     "hooks.steer[0].site: layer 7 is out of range"),
    ({"steer": [{"site": "blocks.1.hook_resid_post", "op": "add", "vector": [1.0] * 3}]},
     "hooks.steer[0].vector: length 3"),
    ({"steer": [{"site": "blocks.1.hook_resid_post", "op": "add",
                 "vector": [float("nan")] * HIDDEN}]}, "hooks.steer[0].vector"),
    ({"steer": [{"site": "blocks.1.hook_resid_post", "op": "add",
                 "vector": [float("inf")] * HIDDEN}]}, "hooks.steer[0].vector"),
    ({"steer": [{"site": "blocks.1.hook_resid_post", "op": "rotate", "vector": [1.0] * HIDDEN}]},
     "hooks.steer[0].op"),
    ({"steer": [{"site": "blocks.1.hook_resid_post", "op": "add", "vector": vector(HIDDEN, s)}
                for s in range(5)]}, "hooks.steer: 5 distinct vectors"),
]


def drain(engine):
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_bad_specs_fail_alone(engines):
    llm, rec, mix_ids, _ = engines
    engine = llm.llm_engine
    solo = batch(llm, [mix_ids[1]], [MIX_HOOKS[1]])[0]
    engine.add_request("good", {"prompt_token_ids": mix_ids[1]}, params(MIX_HOOKS[1]))
    engine.add_request("plain", {"prompt_token_ids": mix_ids[0]}, params())
    for i, (hooks, field) in enumerate(BAD):
        with pytest.raises(ValueError) as e:
            engine.add_request(f"bad{i}", {"prompt_token_ids": mix_ids[2]}, params(hooks))
        assert field in str(e.value), str(e.value)
    done = drain(engine)
    assert set(done) == {"good", "plain"}
    assert result(done["good"]) == solo
    assert result(done["plain"])[0] == rec["mix"][0][0]


def test_resident_vector_table_refuses_at_admission(engines):
    llm, _, mix_ids, _ = engines
    engine = llm.llm_engine
    three = {"steer": [{"site": "blocks.1.hook_resid_post", "op": "add", "scale": 0.5,
                        "vector": vector(HIDDEN, 10 + s)} for s in range(3)]}
    two_new = {"steer": [{"site": "blocks.2.hook_resid_pre", "op": "add", "scale": 0.5,
                          "vector": vector(HIDDEN, 20 + s)} for s in range(2)]}
    engine.add_request("x", {"prompt_token_ids": mix_ids[0]}, params(three))
    with pytest.raises(ValueError, match=r"live requests hold 3 of the 4 slots"):
        engine.add_request("y", {"prompt_token_ids": mix_ids[1]}, params(two_new))
    assert set(drain(engine)) == {"x"}
    engine.add_request("y", {"prompt_token_ids": mix_ids[1]}, params(two_new))  # fits now (LRU)
    assert set(drain(engine)) == {"y"}


def test_one_shared_params_object_steers_every_prompt(engines, llama_path):
    """Issue 16 item 2, offline: one SamplingParams with skip_clone=True for many prompts
    (vLLM then shallow-copies it per prompt): every prompt is steered."""
    llm, _, mix_ids, _ = engines
    solo = [batch(llm, [ids], [MIX_HOOKS[1]])[0] for ids in mix_ids[:3]]
    shared = params(MIX_HOOKS[1], skip_clone=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in mix_ids[:3]], shared,
                        use_tqdm=False)
    assert [result(o) for o in outs] == solo


def test_a_user_salt_never_reaches_steered_blocks(engines):
    """Issue 16 item 4: a plain request that sends, as its own cache_salt, the salt a
    steered request gets must not fill blocks the steered request then reads."""
    llm, _, _, (ids, _) = engines
    frontend = llm.llm_engine.input_processor.hooks
    salt = frontend.process_request("probe", params(STEER), None, len(ids))
    one = lambda p, h=None: llm.generate([p], params(h), use_tqdm=False)[0]
    llm.reset_prefix_cache()
    cold = result(one({"prompt_token_ids": ids}, STEER))
    llm.reset_prefix_cache()
    one({"prompt_token_ids": ids, "cache_salt": salt})  # plain, the steered salt as its own
    warm = one({"prompt_token_ids": ids}, STEER)
    assert not warm.num_cached_tokens and result(warm) == cold


def test_relative_rules_never_share_blocks_across_prompt_lengths(engines):
    """Issue 16 item 4: "generated" steers a request's own output; the next turn sends
    that output back as prompt, where the rule does not steer it. Its blocks (cached
    while they were generated, steered) must not be read as the new prompt's."""
    llm, _, _, (ids, _) = engines
    rule = {"steer": [{**STEER["steer"][0], "positions": "generated"}]}
    one = lambda i, n=16: llm.generate([{"prompt_token_ids": i}], params(rule, n),
                                       use_tqdm=False)[0]
    llm.reset_prefix_cache()
    first = one(ids, 40)
    turn = ids + list(first.outputs[0].token_ids)
    llm.reset_prefix_cache()
    cold = result(one(turn))
    llm.reset_prefix_cache()
    one(ids, 40)
    warm = one(turn)
    assert not warm.num_cached_tokens and result(warm) == cold


def held(llm) -> tuple[dict, list[dict]]:
    """What the frontend and the worker hold now (graphtap's stats)."""
    return llm.llm_engine.input_processor.hooks.stats(), llm.collective_rpc("graphtap_hook_stats")


def assert_all_free(llm):
    frontend, workers = held(llm)
    assert not any(v for k, v in frontend.items() if k != "saved_bytes"), frontend
    for worker in workers:
        for family, counts in worker.items():
            assert not any(v for k, v in counts.items() if k != "vectors_resident" and not k.endswith("_total")), \
                (family, counts)


def test_aborts_free_everything(engines):
    """Fault test (issue 16): requests aborted through the engine, mid-decode and while
    still prefilling, leave nothing held in the frontend or the worker, and the engine
    serves the next request as before."""
    llm, rec, mix_ids, (ids, _) = engines
    engine = llm.llm_engine
    steer = MIX_HOOKS[1]
    engine.add_request("decoding", {"prompt_token_ids": mix_ids[1]}, params(steer, 200))
    for _ in range(3):
        engine.step()
    engine.add_request("prefilling", {"prompt_token_ids": ids * 3}, params(STEER, 50))
    engine.abort_request(["decoding", "prefilling"])
    drain(engine)
    frontend, _ = held(llm)
    assert not any(v for k, v in frontend.items() if k != "saved_bytes"), frontend
    # vLLM tells the runner which requests ended with its next step: the worker frees
    # them then (before that step's new requests take slots).
    assert batch(llm, [mix_ids[0]], [None])[0] == rec["mix"][0]
    assert_all_free(llm)
