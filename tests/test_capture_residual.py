"""Residual-stream capture returned per request (tiny Llama, eager; one engine).

HF transformers with module hooks is the reference; every row is labelled with its
position and compared position by position."""
import numpy as np
import pytest
import torch

from graphtap.testing.engines import _hf_model, make_llm, shutdown, tokenize
from graphtap.testing.hf_reference import hf_attention_pattern, hf_capture
from helpers import vector

SITES = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_mid", "blocks.3.hook_resid_post"]
LONG = ("Interpretability engineers read the residual stream of a transformer. " * 6).strip()
TOL = 1e-4
PATTERN = "blocks.1.attn.hook_pattern"
ENGINE_SITES = ["blocks.*.hook_resid_pre", "blocks.*.hook_resid_mid", "blocks.*.hook_resid_post",
                PATTERN]


def params(hooks=None, max_tokens=8, **kw):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          hooks=hooks, **kw)


def capture(sites=SITES, positions="all", dtype="float32", **extra):
    return {"capture": [{"site": s, "positions": positions, "dtype": dtype} for s in sites],
            **extra}


@pytest.fixture(scope="module")
def save_root(tmp_path_factory):
    return tmp_path_factory.mktemp("saved")


@pytest.fixture(scope="module")
def engine(llama_path, save_root):
    # Small batches: a long prompt is split by chunked prefill.
    llm = make_llm(llama_path, hook_manager="graphtap", block_size=32, enable_prefix_caching=True,
                   max_num_batched_tokens=48,
                   hook_config={"capture_rows": 512, "save_root": str(save_root),
                                "sites": ENGINE_SITES, "probe_ring": 16})
    yield llm
    shutdown(llm)


def generate(llm, ids_list, hooks_list, **kw):
    outs = llm.generate([{"prompt_token_ids": ids} for ids in ids_list],
                        [params(h, **kw) for h in hooks_list], use_tqdm=False)
    return outs


def assert_matches_hf(out, hf, ids, sites, steer=None, max_tokens=8):
    want, wpos, tokens = hf_capture(hf, ids, max_tokens, sites, steer)
    assert list(out.outputs[0].token_ids) == tokens
    assert out.hooks.error is None
    for s in sites:
        assert out.hooks.positions[s].tolist() == wpos[s].tolist(), s
        err = (out.hooks[s].float() - want[s]).abs().max().item()
        assert err <= TOL, (s, err)


def test_every_residual_site_matches_hf(engine, llama_path):
    ids = tokenize(llama_path, ["The quick brown fox jumps over"])[0]
    sites = [f"blocks.{l}.hook_resid_{k}" for l in range(4) for k in ("pre", "mid", "post")][:8]
    out = generate(engine, [ids], [capture(sites)])[0]
    assert_matches_hf(out, _hf_model(str(llama_path)), ids, sites)
    assert len(out.hooks.positions[sites[0]]) == len(ids) + 8 - 1  # the last token never runs


def test_capture_sees_steering_and_mixes_in_a_batch(engine, llama_path):
    hf = _hf_model(str(llama_path))
    ids = tokenize(llama_path, ["Steering vectors shift the hidden state", "Numbers like 12, 40",
                                "Prompt injection asks a model to ignore"])
    steer = {"steer": [{"site": "blocks.1.hook_resid_mid", "op": "add", "scale": 4.0,
                        "vector": vector(256, 3)}]}
    specs = [capture(**steer), None, capture(positions="generated")]
    outs = generate(engine, ids, specs)
    assert_matches_hf(outs[0], hf, ids[0], SITES, steer)
    assert outs[1].hooks is None
    want, wpos, _ = hf_capture(hf, ids[2], 8, SITES)
    for s in SITES:
        gen = wpos[s] >= len(ids[2])
        assert outs[2].hooks.positions[s].tolist() == wpos[s][gen].tolist()
        assert (outs[2].hooks[s] - want[s][gen]).abs().max() <= TOL


def test_dtype_model_and_position_selectors(engine, llama_path):
    ids = tokenize(llama_path, ["The quick brown fox jumps over"])[0]
    spec = {"capture": [{"site": "blocks.2.hook_resid_post", "positions": "last_prompt"},
                        {"site": "blocks.1.hook_resid_pre", "positions": [0, 3, 9]},
                        {"site": "blocks.0.hook_resid_mid", "positions": {"start": 2, "end": 5}}]}
    h = generate(engine, [ids], [spec])[0].hooks
    assert h.positions["blocks.2.hook_resid_post"].tolist() == [len(ids) - 1]
    assert h.positions["blocks.1.hook_resid_pre"].tolist() == [0, 3, 9]
    assert h.positions["blocks.0.hook_resid_mid"].tolist() == [2, 3, 4]
    assert h["blocks.2.hook_resid_post"].dtype == torch.float32  # the tiny model is fp32


def test_chunked_prefill_and_prefix_cache_are_complete(engine, llama_path):
    ids = tokenize(llama_path, [LONG])[0]
    assert len(ids) > 48  # longer than a step's token budget: prefill in chunks
    spec = capture(SITES + [PATTERN])
    engine.reset_prefix_cache()
    cold = generate(engine, [ids], [spec])[0]
    assert_matches_hf(cold, _hf_model(str(llama_path)), ids, SITES)
    # Patterns over every key, the earlier chunks' too (read from the paged cache).
    ran = ids + list(cold.outputs[0].token_ids)[:-1]
    want = hf_attention_pattern(_hf_model(str(llama_path)), ran, 1)
    assert cold.hooks.positions[PATTERN].tolist() == list(range(len(ran)))
    assert (cold.hooks[PATTERN] - want).abs().max().item() <= TOL
    warm_plain = generate(engine, [ids], [None])[0]  # fills and reads the cache
    assert warm_plain.num_cached_tokens
    again = generate(engine, [ids], [spec])[0]  # would hit the cache: must recompute
    for s in SITES + [PATTERN]:
        assert again.hooks.positions[s].tolist() == cold.hooks.positions[s].tolist()
        assert torch.equal(again.hooks[s], cold.hooks[s])


def test_save_to_writes_one_safetensors_file_per_request(engine, llama_path, save_root):
    from safetensors.torch import load_file

    ids = tokenize(llama_path, ["Numbers like 12, 40", "The quick brown fox"])
    outs = generate(engine, ids, [capture(save_to="run1")] * 2)
    files = sorted((save_root / "run1").glob("*.safetensors"))
    assert len(files) == 2
    saved = [load_file(f) for f in files]
    by_len = {len(d[f"{SITES[0]}.positions"]): d for d in saved}
    for out in outs:
        d = by_len[len(out.hooks.positions[SITES[0]])]
        assert torch.equal(d[SITES[1]], out.hooks[SITES[1]])
        assert out.hooks.save_error is None and (save_root / out.hooks.saved_to).is_file()


def test_a_failed_save_fails_that_save_only(engine, llama_path, save_root):
    """Issue 16 item 7: a save_to that passes admission but cannot be written (a file
    or a symlink on the way) fails that request's save, with the reason; its captures
    still come back and the engine serves the next request."""
    ids = tokenize(llama_path, ["Numbers like 12, 40"])
    (save_root / "afile").write_text("x")
    (save_root / "alink").symlink_to(save_root.parent)
    for bad in ("afile/run", "alink/run"):
        out = generate(engine, ids, [capture(save_to=bad)])[0]
        assert out.hooks.saved_to is None and out.hooks.save_error.startswith(
            "hooks.save_to: not saved"), out.hooks.save_error
        assert out.hooks[SITES[1]].shape[0] == len(ids[0]) + 7
    assert not list(save_root.parent.glob("run"))
    ok = generate(engine, ids, [capture(save_to="after")])[0]
    assert ok.hooks.save_error is None and (save_root / ok.hooks.saved_to).is_file()


def test_soak_200_requests_attributed_exactly(engine, llama_path):
    rng = np.random.default_rng(5)
    prompts = tokenize(llama_path, ["The quick brown fox", "Steering vectors shift",
                                    "Prompt injection asks a model", "Numbers like 12, 40",
                                    "Hallucination probes are linear"])
    steers = [None, {"steer": [{"site": "blocks.2.hook_resid_pre", "op": "add", "scale": 2.0,
                                "vector": vector(256, 9)}]},
              {"steer": [{"site": "blocks.1.hook_resid_post", "op": "ablate",
                          "vector": vector(256, 10)}]}]
    caps = [capture(), capture(["blocks.3.hook_resid_mid"], positions="prompt"), None,
            capture(["blocks.2.hook_resid_post"], positions="generated", dtype="model"),
            {"capture": [{"site": PATTERN, "heads": [2], "dtype": "float32"},
                         {"site": "blocks.0.hook_resid_pre", "positions": "last_prompt"}]}]
    combos = [(p, s, c) for p in range(5) for s in range(3) for c in range(len(caps))]
    picks = [combos[i] for i in rng.integers(0, len(combos), 200)]

    def spec(s, c):
        return {**(steers[s] or {}), **(caps[c] or {})} or None

    outs = generate(engine, [prompts[p] for p, _, _ in picks],
                    [spec(s, c) for _, s, c in picks])
    solo = {}
    missing = misattributed = 0
    for (p, s, c), out in zip(picks, outs):
        key = (p, s, c)
        if key not in solo:
            solo[key] = generate(engine, [prompts[p]], [spec(s, c)])[0]
        ref = solo[key]
        assert list(out.outputs[0].token_ids) == list(ref.outputs[0].token_ids)
        if caps[c] is None:
            assert out.hooks is None
            continue
        for site in ref.hooks:
            got_pos = out.hooks.positions.get(site)
            if got_pos is None or got_pos.tolist() != ref.hooks.positions[site].tolist():
                missing += 1
            elif (out.hooks[site].float() - ref.hooks[site].float()).abs().max() > TOL:
                misattributed += 1
    assert (missing, misattributed) == (0, 0)


def test_save_to_stays_inside_save_root(engine, llama_path):
    ids = tokenize(llama_path, ["Numbers like 12, 40"])
    for bad in ("../escape", "/etc"):
        with pytest.raises(ValueError, match=r"hooks.save_to: .* is not a plain relative folder"):
            generate(engine, ids, [capture(save_to=bad)])


def test_probe_rows_come_home_however_the_request_ends(engine, llama_path):
    """Probe rows are held on the worker until a step that may finish the request
    (courier/held.py): whether it ends at its length, on a stop token or on a stop string
    (held rows then go home every step, in many chunks), every generated position that
    ran comes back once, in a batch with chunked prefill beside it, and each score is its
    probe of the residual the same request captured."""
    from vllm import SamplingParams

    ids = tokenize(llama_path, [LONG])[0]
    site = "blocks.3.hook_resid_post"
    w = vector(256, 41)
    spec = {"probe": [{"site": site, "weights": [w], "positions": "generated"}],
            "capture": [{"site": site, "positions": "generated", "dtype": "float32"}]}
    free = engine.generate([{"prompt_token_ids": ids}], params(max_tokens=16), use_tqdm=False)
    tokens = list(free[0].outputs[0].token_ids)
    k = next(i for i in range(3, 16) if tokens[i] not in tokens[:i])  # first new token
    text = engine.get_tokenizer().decode(tokens[:k + 1])
    stop_text = text[-3:]
    cases = {"length": dict(max_tokens=12),
             "stop token": dict(max_tokens=16, ignore_eos=False, stop_token_ids=[tokens[k]]),
             "stop string": dict(max_tokens=16, stop=[stop_text])}
    ps = [SamplingParams(temperature=0.0, hooks=spec, **{"ignore_eos": True, **kw})
          for kw in cases.values()]
    outs = engine.generate([{"prompt_token_ids": ids}] * len(ps) + [{"prompt_token_ids": ids[:9]}],
                           ps + [params(capture([site]), max_tokens=4)], use_tqdm=False)
    for (name, kw), out in zip(cases.items(), outs):
        n = len(out.outputs[0].token_ids)
        assert out.hooks.error is None, (name, out.hooks.error)
        got = out.hooks.positions[f"probe:{site}"].tolist()
        assert got[:n - 1] == list(range(len(ids), len(ids) + n - 1)), name
        assert got == sorted(set(got)), name  # each position once
        if name == "stop token":
            assert out.outputs[0].finish_reason == "stop" and n == k + 1
        own = out.hooks[site] @ torch.tensor(w)
        rows = out.hooks.positions[site].tolist()
        keep = [rows.index(p) for p in got]
        torch.testing.assert_close(out.hooks[f"probe:{site}"][:, 0], own[keep], rtol=1e-5,
                                   atol=1e-5 * own.abs().max().item())
    assert outs[-1].hooks.error is None  # the plain capture beside them
    (stats,) = engine.collective_rpc("graphtap_hook_stats")
    # decode steps left the scores in the device ring (probe_ring 16: read when half
    # full, and when a request may finish; the length case alone reads twice); the stop
    # string's request routed rows instead (it may finish at every step)
    assert stats["probe"]["ring_steps_total"] > 0 and stats["probe"]["ring_reads_total"] >= 2
    # the hook manager's host time per phase of the steps (profiling.HostClock)
    host = stats["host"]
    assert host["add_request_calls_total"] >= len(outs)
    for phase in ("prepare_step", "prepare_plan", "prepare_route_tokens", "prepare_route_rows",
                  "collect", "to_cpu", "per_request", "apply_staged_writes"):
        assert host[f"{phase}_calls_total"] > 0, phase
        assert host[f"{phase}_cpu_ms_total"] <= host[f"{phase}_wall_ms_total"] + 1.0, phase
