"""graphtap behind `vllm serve` (started with `graphtap serve`): top-level `hooks` in
completions and chat requests, `hooks` in responses (raw and safetensors, streamed on the
final chunk), named vectors, limits, concurrency, disconnects, sampling on CPU, and the
client. The module first runs an offline engine with the same arguments for the reference
outputs, shuts it down, then starts the server (one engine at a time)."""
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from graphtap.testing.engines import make_llm, shutdown, tokenize
from graphtap.wire import decode
from helpers import post, vector, vllm_server

KEY = "test-key"
SITES = ["blocks.*.hook_resid_post", "blocks.1.hook_resid_mid", "blocks.1.attn.hook_q",
         "blocks.1.attn.hook_k", "blocks.1.attn.hook_pattern"]
HOOK_CONFIG = {"sites": SITES, "max_vectors": 4, "max_response_rows": 4096,
               "max_request_bytes": 256 * 1024}
ENGINE = dict(dtype="float32", gpu_memory_utilization=0.3, max_model_len=512, seed=0,
              max_num_seqs=16)
CAPTURE = [{"site": "blocks.2.hook_resid_post", "dtype": "float32"},
           {"site": "blocks.1.hook_resid_mid", "positions": "last_prompt"},
           {"site": "blocks.1.attn.hook_q", "heads": [0, 2]},
           {"site": "blocks.1.attn.hook_k", "heads": [1], "positions": "prompt"},
           {"site": "blocks.1.attn.hook_pattern", "heads": [3], "positions": "generated"}]
STEER = [{"site": "blocks.2.hook_resid_post", "op": "add", "scale": 4.0,
          "vector": vector(256, 11)}]
SPEC = {"steer": STEER, "capture": CAPTURE}
PROMPT = "Steering vectors shift the hidden state"
# ~290 tokens: its prefill step's rows per site (290 KB in float32) travel as frames, in a
# message after the step's tokens (patch 0008)
LONG = ("Captured rows cross the socket after the tokens of their step. " * 8).strip()
LONG_SITES = [f"blocks.{layer}.hook_resid_post" for layer in range(4)]
LONG_SPEC = {"capture": [{"site": s, "dtype": "float32"} for s in LONG_SITES]}
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "assistant:")


def params(hooks=None, max_tokens=8, **kw):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          hooks=hooks, **kw)


@pytest.fixture(scope="module")
def offline(llama_path):
    """References from an offline engine with the server's arguments."""
    llm = make_llm(llama_path, hook_manager="graphtap", hook_config=HOOK_CONFIG, **ENGINE)
    ids = tokenize(llama_path, [PROMPT])[0]
    try:
        out = llm.generate([{"prompt_token_ids": ids}], params(SPEC), use_tqdm=False)[0]
        plain = llm.generate([{"prompt_token_ids": ids}], params(), use_tqdm=False)[0]
        chat_ids = tokenize(llama_path, [f"user: {PROMPT}\nassistant:"])[0]
        chat = llm.generate([{"prompt_token_ids": chat_ids}], params(SPEC), use_tqdm=False)[0]
        long_ids = tokenize(llama_path, [LONG])[0]
        long = llm.generate([{"prompt_token_ids": long_ids}], params(LONG_SPEC),
                            use_tqdm=False)[0]
        ref = {"ids": ids, "tokens": list(out.outputs[0].token_ids), "hooks": out.hooks,
               "plain": list(plain.outputs[0].token_ids), "chat_ids": chat_ids,
               "chat_tokens": list(chat.outputs[0].token_ids), "chat_hooks": chat.hooks,
               "long_ids": long_ids, "long_tokens": list(long.outputs[0].token_ids),
               "long_hooks": long.hooks}
    finally:
        shutdown(llm)
    return ref


@pytest.fixture(scope="module")
def server(offline, llama_path, tmp_path_factory):
    from safetensors.numpy import save_file

    root = tmp_path_factory.mktemp("serve-api")
    (root / "vectors").mkdir()
    save_file({"v": np.asarray(vector(256, 21), np.float32)}, str(root / "vectors" / "calm.safetensors"))
    (root / "template.jinja").write_text(TEMPLATE)
    config = {**HOOK_CONFIG, "vectors_dir": str(root / "vectors")}
    args = ["--hook-config", json.dumps(config), "--api-key", KEY, "--enforce-eager",
            "--dtype", "float32", "--gpu-memory-utilization", "0.3", "--max-model-len", "512",
            "--seed", "0", "--max-num-seqs", "16", "--served-model-name", "m",
            "--chat-template", str(root / "template.jinja")]
    with vllm_server(llama_path, args, root / "server.log", graphtap_cli=True) as base:
        yield base


def call(base, path, body, key=KEY):
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"}
                                                      if key else {})}
    req = urllib.request.Request(base + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def completion(base, prompt, hooks=None, xargs=False, **kw):
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **kw}
    if hooks is not None:
        if xargs:
            body["vllm_xargs"] = {"hooks": json.dumps(hooks)}
        else:
            body["hooks"] = hooks
    return call(base, "/v1/completions", body)


def assert_same(got, want):
    assert got.error is None and want.error is None, (got.error, want.error)
    assert set(got) == set(want)
    for site in want:
        assert got[site].dtype == want[site].dtype, site
        assert torch.equal(got[site], want[site]), site
        assert got.positions[site].tolist() == want.positions[site].tolist(), site


@pytest.mark.parametrize("encoding", ["raw", "safetensors"])
def test_completion_hooks_equal_offline(server, offline, encoding):
    status, body = completion(server, offline["ids"], {**SPEC, "encoding": encoding})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == offline["tokens"] != offline["plain"]
    assert_same(decode(choice["hooks"], as_torch=True), offline["hooks"])


def test_rows_sent_after_their_tokens_equal_hf_offline_and_served(server, offline,
                                                                     llama_path):
    """A long prompt's prefill rows (frames) leave the engine core in a message after the
    step's tokens (patch 0008): offline and over HTTP they are HF's, every position."""
    from graphtap.testing.engines import _hf_model
    from graphtap.testing.hf_reference import hf_capture

    ids, got = offline["long_ids"], offline["long_hooks"]
    assert 256 <= len(ids) <= 500
    want, positions, tokens = hf_capture(_hf_model(str(llama_path)), ids, 8, LONG_SITES)
    assert offline["long_tokens"] == tokens and got.error is None
    for site in LONG_SITES:
        assert got.positions[site].tolist() == positions[site].tolist(), site
        assert (got[site] - want[site]).abs().max().item() <= 1e-4, site
    status, body = completion(server, ids, LONG_SPEC)
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == tokens
    assert_same(decode(body["choices"][0]["hooks"], as_torch=True), got)


def test_a_stop_string_on_the_first_token_keeps_the_prompt_s_rows(server, offline,
                                                                     llama_path):
    """The frontend finishes a request on a stop string in its first token: its prefill
    step's large rows ride inside that step's message, not in one after it (patch 0008),
    which arrived after the finish and was dropped (the request came back without a row)."""
    from transformers import AutoTokenizer

    ids, want = offline["long_ids"], offline["long_hooks"]
    text = AutoTokenizer.from_pretrained(str(llama_path)).decode(offline["long_tokens"][:1])
    stop = text.strip()[:1] or text[:1]
    status, body = completion(server, ids, LONG_SPEC, stop=[stop])
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and len(choice["token_ids"]) == 1, choice
    got = decode(choice["hooks"], as_torch=True)
    assert got.error is None
    for site in LONG_SITES:  # every prompt position, as the run without a stop string
        assert got.positions[site].tolist() == list(range(len(ids))), site
        assert torch.equal(got[site], want[site][:len(ids)]), site


def test_vllm_xargs_string_still_works(server, offline):
    status, body = completion(server, offline["ids"], SPEC, xargs=True)
    assert status == 200, body
    assert_same(decode(body["choices"][0]["hooks"], as_torch=True), offline["hooks"])


def test_chat_hooks_equal_offline(server, offline):
    status, body = call(server, "/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
        "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "hooks": SPEC})
    assert status == 200, body
    assert body["prompt_token_ids"] == offline["chat_ids"]
    choice = body["choices"][0]
    assert choice["token_ids"] == offline["chat_tokens"]
    assert_same(decode(choice["hooks"], as_torch=True), offline["chat_hooks"])


def stream_chunks(base, path, body):
    import httpx

    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=300,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line.strip() != "data: [DONE]"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streaming_final_chunk_carries_the_hooks(server, offline, chat):
    base = {"model": "m", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "hooks": SPEC, "stream_options": {"include_usage": True}}
    if chat:
        chunks = stream_chunks(server, "/v1/chat/completions",
                               {**base, "messages": [{"role": "user", "content": PROMPT}]})
        want = offline["chat_hooks"]
    else:
        chunks = stream_chunks(server, "/v1/completions", {**base, "prompt": offline["ids"]})
        want = offline["hooks"]
    with_hooks = [c for c in chunks for ch in c.get("choices", []) if "hooks" in ch]
    assert len(with_hooks) == 1 and with_hooks[0]["choices"][0]["finish_reason"] == "length"
    assert_same(decode(with_hooks[0]["choices"][0]["hooks"], as_torch=True), want)


@pytest.mark.parametrize("xargs", [False, True], ids=["hooks", "vllm_xargs"])
def test_every_prompt_of_a_multi_prompt_request_is_steered(server, offline, xargs):
    """The prompts of one request share its extra_args: taking the spec from that dict
    once steered the first prompt only."""
    steer = {"steer": STEER}
    status, body = completion(server, [offline["ids"]] * 3, steer, xargs=xargs)
    assert status == 200, body
    assert [c["token_ids"] for c in body["choices"]] == [offline["tokens"]] * 3


BAD = [  # (hooks, the field the 4xx must name)
    ({"steer": "x"}, "hooks.steer"),
    ({"steer": [{"site": 3, "op": "add", "vector": [1.0] * 256}]}, "hooks.steer[0].site"),
    ({"steer": [{"site": "blocks.1.hook_nope", "op": "add", "vector": [1.0] * 256}]},
     "hooks.steer[0].site"),
    ({"steer": [{"site": "blocks.9.hook_resid_post", "op": "add", "vector": [1.0] * 256}]},
     "hooks.steer[0].site"),
    ({"steer": [{"site": "blocks.-1.hook_resid_post", "op": "add", "vector": [1.0] * 256}]},
     "hooks.steer[0].site"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "vector": [1.0] * 3}]},
     "hooks.steer[0].vector"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "vector": ["a"] * 256}]},
     "hooks.steer[0].vector"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "vector": "nobody"}]},
     "hooks.steer[0].vector"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "vector": [1e39] * 256}]},
     "hooks.steer[0].vector"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "spin", "vector": [1.0] * 256}]},
     "hooks.steer[0].op"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "scale": "big",
                 "vector": [1.0] * 256}]}, "hooks.steer[0].scale"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "set_projection",
                 "vector": [1.0] * 256}]}, "hooks.steer[0]"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "vector": [1.0] * 256,
                 "positions": "middle"}]}, "hooks.steer[0].positions"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "vector": [1.0] * 256,
                 "positions": [1, -4]}]}, "hooks.steer[0].positions"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "vector": [1.0] * 256,
                 "positions": {"start": 9, "end": 2}}]}, "hooks.steer[0].positions"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "vector": [1.0] * 256,
                 "positions": [10 ** 9]}]}, "hooks.steer[0].positions"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "vector": [1.0] * 256,
                 "colour": "red"}]}, "hooks.steer[0].colour"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add",
                 "vector": vector(256, s)} for s in range(9)]}, "hooks.steer"),
    ({"capture": [{"site": "blocks.1.attn.hook_q", "heads": [7]}]}, "hooks.capture[0].heads"),
    ({"capture": [{"site": "blocks.1.attn.hook_q", "heads": [-1]}]}, "hooks.capture[0].heads"),
    ({"capture": [{"site": "blocks.2.hook_resid_post", "heads": [0]}]},
     "hooks.capture[0].heads"),
    ({"capture": [{"site": "blocks.0.hook_resid_pre"}]}, "hooks.capture[0].site"),
    ({"capture": [{"site": "blocks.2.hook_resid_post", "dtype": "int8"}]},
     "hooks.capture[0].dtype"),
    ({"capture": [{"site": "blocks.2.hook_resid_post"}] * 2}, "hooks.capture[1].site"),
    ({"capture": [{"site": f"blocks.{i % 4}.hook_resid_post"} for i in range(40)]},
     "hooks.capture"),
    ({"capture": [{"site": "blocks.2.hook_resid_post"}], "save_to": "../../etc"},
     "hooks.save_to"),
    ({"capture": [{"site": "blocks.2.hook_resid_post"}], "encoding": "pickle"},
     "hooks.encoding"),
    ({"capture": [{"site": "blocks.2.hook_resid_post", "positions": "everything"}]},
     "hooks.capture[0].positions"),
    ({"steer": [], "colour": 1}, "hooks.colour"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "vector": "x" * 10 ** 5}]},
     "hooks.steer[0].vector"),
    # issue 16: values that overflow the float32 tables (and poisoned the next request),
    # bools and numeric strings as numbers, sites spelled another way, save_to "~"
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "scale": 1e300,
                 "vector": [1.0] * 256}]}, "hooks.steer[0].scale"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "set_projection", "target": 1e300,
                 "vector": [1.0] * 256}]}, "hooks.steer[0].target"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "scale": True,
                 "vector": [1.0] * 256}]}, "hooks.steer[0].scale"),
    ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "vector": ["1.0"] * 256}]},
     "hooks.steer[0].vector"),
    ({"capture": [{"site": "blocks.1.attn.hook_q", "heads": [True]}]},
     "hooks.capture[0].heads"),
    ({"capture": [{"site": "blocks.02.hook_resid_post"}]}, "hooks.capture[0].site"),
    ({"capture": [{"site": "blocks.2.hook_resid_post\n"}]}, "hooks.capture[0].site"),
    ({"capture": [{"site": "blocks.\u0662.hook_resid_post"}]}, "hooks.capture[0].site"),
    ({"capture": [{"site": "blocks.2.hook_resid_post"}], "save_to": "~"}, "hooks.save_to"),
]


def test_malformed_specs_are_4xx_naming_the_field_and_harm_nothing(server, offline):
    assert len(BAD) >= 25
    good = completion(server, offline["ids"], SPEC)[1]["choices"][0]
    for hooks, field in BAD:
        status, body = completion(server, offline["ids"], hooks)
        assert 400 <= status < 500, (hooks, status, body)
        assert field in json.dumps(body), (field, body)
        again = completion(server, offline["ids"], SPEC)
        assert again[0] == 200 and again[1]["choices"][0]["token_ids"] == good["token_ids"]
        assert_same(decode(again[1]["choices"][0]["hooks"], as_torch=True),
                    decode(good["hooks"], as_torch=True))
    # and ones that never reach the spec parser
    assert completion(server, offline["ids"], xargs=True,
                      hooks="{not json")[0] == 400  # a JSON string that is not JSON
    status, body = completion(server, offline["ids"], {"steer": [{"site": "blocks.2.hook_resid_post",
                              "op": "add", "vector": [0.5] * 100000}]})
    assert status == 413 and "max_request_bytes" in json.dumps(body)


def test_n_above_one_with_captures_is_a_400_and_steering_applies_to_every_choice(server,
                                                                                   offline):
    # sampled (n > 1 needs it), yet deterministic: top_k 1 keeps the argmax
    sampled = dict(n=2, temperature=1.0, top_k=1)
    status, body = completion(server, offline["ids"], {"capture": CAPTURE[:1]}, **sampled)
    assert status == 400 and "n > 1" in json.dumps(body), body
    status, body = completion(server, offline["ids"], {"steer": STEER}, **sampled)
    assert status == 200 and [c["token_ids"] for c in body["choices"]] == [offline["tokens"]] * 2


def test_sampling_works_on_cpu(server, offline):
    """The V2 sampler's gumbel kernel once killed the engine on CPU (no libdevice in
    Triton's interpreter): every client defaults to temperature 1."""
    import urllib.request

    options = [dict(temperature=0.9, seed=1), dict(temperature=1.0, top_p=0.9),
               dict(temperature=1.0, top_k=5), dict(temperature=1.0, min_p=0.1),
               dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3,
                    repetition_penalty=1.2), dict(temperature=0.7, logprobs=3),
               dict(temperature=1.0, n=3, seed=3)]
    for kw in options:
        status, body = completion(server, offline["ids"], max_tokens=6, **kw)
        assert status == 200 and all(len(c["token_ids"]) == 6 for c in body["choices"]), \
            (kw, body)
    # sampled and steered with the same seed: the same tokens twice
    a, b = (completion(server, offline["ids"], {"steer": STEER}, temperature=0.9, seed=7)
            for _ in range(2))
    assert a[1]["choices"][0]["token_ids"] == b[1]["choices"][0]["token_ids"]
    with urllib.request.urlopen(server + "/health", timeout=5) as r:
        assert r.status == 200


def test_a_response_s_rows_are_bounded_at_admission(server, offline):
    many = {"capture": [{"site": f"blocks.{i}.hook_resid_post"} for i in range(4)] +
            [{"site": "blocks.1.attn.hook_q"}, {"site": "blocks.1.attn.hook_k"},
             {"site": "blocks.1.attn.hook_pattern"}]}  # (4 + 2) x 506 + 4 heads x 506 rows
    status, body = completion(server, offline["ids"], many, max_tokens=500)
    assert status == 400 and "hook_config.max_response_rows" in json.dumps(body), body
    assert completion(server, offline["ids"], many, max_tokens=8)[0] == 200


def solo_and_mixed_specs(offline):
    specs = [None, {"steer": STEER}, {"capture": CAPTURE[:2]}, SPEC,
             {"steer": [{**STEER[0], "vector": "calm"}], "capture": CAPTURE[2:4]}]
    prompts = [offline["ids"], offline["ids"][:4], offline["ids"][2:]]
    return [(p, s) for p in prompts for s in specs]


def test_100_concurrent_mixed_requests_each_equal_their_solo_run(server, offline):
    cases = solo_and_mixed_specs(offline)
    solo = {i: completion(server, p, s)[1]["choices"][0] for i, (p, s) in enumerate(cases)}
    picks = [i % len(cases) for i in range(100)]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda i: completion(server, *cases[i]), picks))
    for i, (status, body) in zip(picks, results):
        assert status == 200, body
        got, want = body["choices"][0], solo[i]
        assert got["token_ids"] == want["token_ids"], i
        if want["hooks"] is None:
            assert got["hooks"] is None
        else:
            assert_same(decode(got["hooks"], as_torch=True), decode(want["hooks"], as_torch=True))


def test_a_client_that_disconnects_mid_stream_frees_its_slot_and_vectors(server, offline):
    """max_vectors is 4: a stream holding a vector of its own is dropped after its first
    chunk; then four requests with four new vectors at once must all be admitted."""
    import httpx

    body = {"model": "m", "prompt": offline["ids"], "max_tokens": 200, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "hooks": {"steer": [{**STEER[0], "vector": vector(256, 99)}]}}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first chunk: the connection closes
    burst = [{"steer": [{**STEER[0], "vector": vector(256, 200 + k)}]} for k in range(4)]
    for attempt in range(30):  # the server notices the disconnect within a step or two
        with ThreadPoolExecutor(4) as pool:
            statuses = [st for st, _ in pool.map(
                lambda h: completion(server, offline["ids"], h, max_tokens=30), burst)]
        if statuses == [200] * 4:
            break
        threading.Event().wait(0.5)
    assert statuses == [200] * 4, statuses


def test_named_vectors_registry(server, offline):
    import urllib.request

    from safetensors.numpy import save

    assert call(server, "/v1/graphtap/vectors", {"name": "x", "vector": [0.0] * 256},
                key=None)[0] == 401  # --api-key guards the registry like the rest of /v1
    req = urllib.request.Request(server + "/v1/graphtap/vectors",
                                 headers={"Authorization": f"Bearer {KEY}"})
    listed = json.loads(urllib.request.urlopen(req).read())["vectors"]
    assert [v["name"] for v in listed] == ["calm"] and listed[0]["dim"] == 256  # vectors_dir
    inline = completion(server, offline["ids"], {"steer": STEER})[1]["choices"][0]["token_ids"]
    status, body = call(server, "/v1/graphtap/vectors", {"name": "up", "vector": STEER[0]["vector"]})
    assert status == 200 and body["registered"][0]["name"] == "up", body
    named = completion(server, offline["ids"], {"steer": [{**STEER[0], "vector": "up"}]})
    assert named[1]["choices"][0]["token_ids"] == inline  # same vector, same tokens
    blob = save({"a": np.asarray(vector(256, 5), np.float32), "b": np.ones(256, np.float32)})
    req = urllib.request.Request(server + "/v1/graphtap/vectors", blob, {
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/octet-stream"})
    assert [v["name"] for v in json.loads(urllib.request.urlopen(req).read())["registered"]] \
        == ["a", "b"]
    for bad, field in (({"name": "../x", "vector": [0.0] * 256}, "name"),
                       ({"name": "x", "vector": [0.0] * 3}, "vector"),
                       ({"name": "x", "vector": [float("1e39")] * 256}, "vector"),
                       ({"name": "x"}, "vector")):
        status, body = call(server, "/v1/graphtap/vectors", bad)
        assert status == 400 and body["error"]["param"] == field, (bad, body)
    req = urllib.request.Request(server + "/v1/graphtap/vectors", b"not safetensors", {
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/octet-stream"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 400
    delete = urllib.request.Request(server + "/v1/graphtap/vectors/up", method="DELETE",
                                    headers={"Authorization": f"Bearer {KEY}"})
    assert json.loads(urllib.request.urlopen(delete).read()) == {"deleted": "up"}
    status, body = completion(server, offline["ids"], {"steer": [{**STEER[0], "vector": "up"}]})
    assert status == 400 and "no registered vector named 'up'" in json.dumps(body)


def test_a_live_request_keeps_its_vector_when_the_name_is_deleted(server, offline):
    import httpx

    call(server, "/v1/graphtap/vectors", {"name": "brief", "vector": STEER[0]["vector"]})
    body = {"model": "m", "prompt": offline["ids"], "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "hooks": {"steer": [{**STEER[0], "vector": "brief"}]}}
    tokens = []
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        for n, line in enumerate(line for line in r.iter_lines() if line.startswith("data: {")):
            if n == 0:
                httpx.delete(server + "/v1/graphtap/vectors/brief",
                             headers={"Authorization": f"Bearer {KEY}"}).raise_for_status()
            tokens += json.loads(line[6:])["choices"][0]["token_ids"] or []
    assert tokens == offline["tokens"]


def test_the_client_needs_neither_vllm_nor_torch(server, offline, tmp_path):
    """graphtap.Client in a process where importing torch or vllm fails."""
    import subprocess
    import sys

    script = tmp_path / "client_run.py"
    script.write_text(f"""
import importlib.abc, json, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "vllm"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
from graphtap import Client
client = Client({server!r}, api_key={KEY!r})
out = client.complete({offline['ids']!r}, hooks={json.dumps(SPEC)}, max_tokens=8,
                      temperature=0, ignore_eos=True, return_token_ids=True)
stream = client.stream({offline['ids']!r}, hooks={json.dumps(SPEC)}, max_tokens=8,
                       temperature=0, ignore_eos=True)
text = "".join(stream)
assert "torch" not in sys.modules and "vllm" not in sys.modules
print(json.dumps({{"type": type(out.hooks["blocks.2.hook_resid_post"]).__module__,
                  "tokens": out.choices[0].token_ids, "stream_text": text == stream.text,
                  "streamed_equal": all((out.hooks[k] == stream.hooks[k]).all() for k in out.hooks),
                  "sites": {{k: v.tolist() for k, v in out.hooks.items()}},
                  "positions": {{k: v.tolist() for k, v in out.hooks.positions.items()}}}}))
""")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["type"] == "numpy" and got["tokens"] == offline["tokens"]
    assert got["stream_text"] and got["streamed_equal"]
    for site, rows in offline["hooks"].items():
        assert np.array_equal(np.asarray(got["sites"][site], np.float32), rows.numpy()), site
        assert got["positions"][site] == offline["hooks"].positions[site].tolist()


def readme_example(name: str) -> str:
    """The README's served example `name`: the fenced block after its marker."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    after = text.split(f"<!-- serve-example: {name} -->", 1)[1]
    return after.split("```", 2)[1].split("\n", 1)[1]


def test_the_readme_s_served_examples_run_as_written(server, tmp_path):
    """The README's curl, openai and client examples, with this server's address, key
    and sizes put in."""
    import shutil
    import subprocess
    import sys

    url = "http://127.0.0.1:8000"
    if shutil.which("curl"):
        curl = readme_example("curl").replace(url, server).replace(
            "curl -s", f"curl -s -H 'Authorization: Bearer {KEY}'")
        res = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
        hooks = json.loads(res.stdout)["choices"][0]["hooks"]
        assert hooks["blocks.2.hook_resid_post"]["shape"] == [1, 256], res.stdout[-500:]
    for name, swaps in (("openai", [(f'"{url}/v1"', f'"{server}/v1"'),
                                    ('api_key="none"', f'api_key="{KEY}"')]),
                        ("client", [(f'Client("{url}")', f'Client("{server}", api_key="{KEY}")'),
                                    ("HIDDEN = 4096", "HIDDEN = 256")])):
        code = readme_example(name)
        for old, new in swaps:
            assert old in code, (name, old)
            code = code.replace(old, new)
        script = tmp_path / f"readme_{name}.py"  # not openai.py: it would shadow the package
        script.write_text(code)
        res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, (name, res.stderr[-2000:])
        assert "256" in res.stdout or "[" in res.stdout, (name, res.stdout)


def test_withheld_captures_reach_the_client_as_an_error(server, offline, llama_path):
    """A pattern capture whose prefill step needs more rows than hook_config.pattern_rows
    (default 256): the response says why its captures were withheld, and the request
    beside it completes as it would alone."""
    long = tokenize(llama_path, ["Interpretability engineers read the residual stream of a "
                                 "transformer. " * 6])[0]
    big = {"capture": [{"site": "blocks.1.attn.hook_pattern", "positions": "prompt"}]}
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda a: completion(server, *a),
                                 [(long, big), (offline["ids"], SPEC)])
    assert first[0] == 200 and "hook_config.pattern_rows" in first[1]["choices"][0]["hooks"]["error"]
    assert decode(first[1]["choices"][0]["hooks"]).error
    assert second[0] == 200 and second[1]["choices"][0]["token_ids"] == offline["tokens"]
    # its own captures fitted the step: it gets them (issue 16 item 5)
    assert_same(decode(second[1]["choices"][0]["hooks"], as_torch=True), offline["hooks"])


@pytest.mark.parametrize("xargs", [False, True], ids=["hooks", "vllm_xargs"])
def test_beam_search_with_hooks_is_refused(server, offline, xargs):
    """Beam search makes its own SamplingParams per beam: the beams ran unsteered and
    the server answered 200 (issue 16 item 3)."""
    status, body = completion(server, offline["ids"], {"steer": STEER}, xargs=xargs,
                              use_beam_search=True, n=2)
    assert status == 400 and "beam search" in json.dumps(body), body
    plain = completion(server, offline["ids"], use_beam_search=True, n=2)
    assert plain[0] == 200, plain  # without hooks, beam search works as in stock vLLM


def raw_post(base, path, data: bytes):
    import urllib.request

    req = urllib.request.Request(base + path, data, {"Content-Type": "application/json",
                                                     "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.mark.parametrize("depth", [3000, 100_000])
def test_json_python_cannot_parse_is_a_400_naming_the_body(server, offline, depth):
    """Nested thousands deep (a 500 before) or a 5000-digit number (a 400 naming no
    field): a 400 naming the body, and the next request is served as before."""
    prefix = json.dumps({"model": "m", "prompt": offline["ids"], "max_tokens": 8,
                         "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
    nested = prefix[:-1].encode() + b', "hooks": {"steer": ' + b"[" * depth + b"]" * depth + b"}}"
    digits = prefix[:-1].encode() + b', "seed": ' + b"7" * 5000 + b"}"
    for body in (nested, digits):
        status, answer = raw_post(server, "/v1/completions", body)
        assert status == 400 and answer["error"]["param"] == "body", (status, answer)
    again = completion(server, offline["ids"], SPEC)
    assert again[0] == 200 and again[1]["choices"][0]["token_ids"] == offline["tokens"]


FUZZED = 150


def test_fuzzed_specs_over_http_are_never_a_5xx_and_harm_nothing(server, offline):
    """Issue 16's fuzzer against the server: every spec is served or refused with a 4xx
    naming a hooks field; never a 5xx or a hang; after each refusal a valid request
    returns exactly its earlier output (tokens and captures)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from spec_strategies import specs, valid_specs

    good = completion(server, offline["ids"], SPEC)[1]["choices"][0]
    seen = {"refused": 0, "served": 0}

    @settings(max_examples=FUZZED, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(specs(256, 4, 4), valid_specs(256, ["blocks.2.hook_resid_post",
                                                         "blocks.1.attn.hook_q"], 4, 4)))
    def one(raw):
        status, body = completion(server, offline["ids"], raw, max_tokens=2)
        assert status < 500, (raw, status, body)
        if status == 200:
            seen["served"] += 1
            return
        seen["refused"] += 1
        assert 400 <= status < 500 and "hooks" in json.dumps(body), (raw, status, body)
        again = completion(server, offline["ids"], SPEC)
        assert again[0] == 200 and again[1]["choices"][0]["token_ids"] == good["token_ids"]
        assert_same(decode(again[1]["choices"][0]["hooks"], as_torch=True),
                    decode(good["hooks"], as_torch=True))

    one()
    assert seen["refused"] > FUZZED // 3 and seen["served"] > 10, seen


def stats(base):
    import httpx

    r = httpx.get(base + "/v1/graphtap/stats", headers={"Authorization": f"Bearer {KEY}"},
                  timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def held(snapshot) -> dict:
    """The non-zero counts of a stats snapshot (resident vectors and saved bytes aside:
    they stay by design)."""
    out = {k: v for k, v in snapshot["frontend"].items() if v and k != "saved_bytes"}
    for i, worker in enumerate(snapshot["workers"] or []):
        for family, counts in worker.items():
            out.update({f"worker{i}.{family}.{k}": v for k, v in counts.items()
                        if v and k != "vectors_resident" and not k.endswith("_total")})
    return out


def wait_until_free(base):
    """Polls the stats until nothing is held. vLLM tells the runner which requests ended
    (aborted by a disconnect, say) with its next step: a one-token request lets it run."""
    import time

    for _ in range(60):
        snapshot = stats(base)
        if not held(snapshot):
            return snapshot
        time.sleep(0.5)
        completion(base, [1, 2, 3], max_tokens=1)
    raise AssertionError(f"still held: {held(snapshot)}")


def test_a_client_that_leaves_while_its_prompt_prefills_frees_everything(server, offline,
                                                                          llama_path):
    """Fault test (issue 16): the client goes away before the first token; the server
    notices, aborts the request and frees its vectors, slots and byte budget."""
    import httpx

    long = tokenize(llama_path, ["Interpretability engineers read the residual stream of a "
                                 "transformer. " * 20])[0][:400]
    body = {"model": "m", "prompt": long, "max_tokens": 50, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "hooks": {"steer": [{**STEER[0], "vector": vector(256, 77)}], "capture": CAPTURE}}
    try:
        httpx.post(server + "/v1/completions", json=body, timeout=0.05,
                   headers={"Authorization": f"Bearer {KEY}"})
    except httpx.TimeoutException:
        pass  # gone before anything came back
    snapshot = wait_until_free(server)
    assert snapshot["workers"], snapshot  # the runner probe answered for every worker
    again = completion(server, offline["ids"], SPEC)
    assert again[0] == 200 and again[1]["choices"][0]["token_ids"] == offline["tokens"]


def test_a_guard_stops_a_request_over_http_and_reports_its_verdict(server, offline):
    """finish_reason "guard" and the verdict in the choice's hooks (the probe's scores
    come back too), streamed or not; the client reads the verdict as `hooks.guard`."""
    probe = {"site": "blocks.2.hook_resid_post", "weights": [vector(256, 40)],
             "positions": "generated"}
    hooks = {"probe": [probe], "guard": {"kind": "probe", "threshold": -1e30,
                                         "action": "stop"}}
    status, body = completion(server, PROMPT, hooks)
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "guard" and len(choice["token_ids"]) == 2
    out = decode(choice["hooks"])
    assert out.guard["flagged"] and out.guard["position"] == len(offline["ids"])
    assert out["probe:blocks.2.hook_resid_post"].shape == (1, 1)
    status, plain = completion(server, PROMPT)
    assert plain["choices"][0]["finish_reason"] == "length"


def test_everything_is_free_once_every_request_has_ended(server):
    """After every test above (disconnects, refusals, overflows, the fuzzer): nothing
    is held in the frontend or the worker."""
    wait_until_free(server)
