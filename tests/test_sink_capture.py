"""Captures sent to the engine's bulk sink (hook_config.sink_dir, `"sink": true` on a
capture entry), one engine on the tiny Llama: the rows land in the sink's shards,
labelled by request and position, equal to the per-request capture of the same prompt
(and HF's residual stream), once each; they never come back with the request; requests
that do not sink in the same batch are untouched; partial shards are written once the
last sink request has left."""
import json

import pytest
import torch
from graphtap.spec import ModelShape, normalise, parse_spec
from graphtap.testing.engines import _hf_model, make_llm, shutdown, tokenize
from graphtap.testing.hf_reference import hf_capture
from safetensors.torch import load_file

SITES = ["blocks.1.hook_resid_mid", "blocks.3.hook_resid_post"]
TEXTS = ["The quick brown fox jumps", "Steering vectors shift the hidden state of a model",
         "Prompt injection", "Numbers like 12, 40 and 7"]


@pytest.fixture(scope="module")
def sink_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sink")


@pytest.fixture(scope="module")
def engine(llama_path, sink_dir):
    llm = make_llm(llama_path, hook_manager="graphtap",
                   hook_config={"sites": SITES, "sink_dir": str(sink_dir),
                                "sink_shard_rows": 7})
    yield llm
    shutdown(llm)


def spec(sink: bool) -> dict:
    return {"capture": [{"site": s, "positions": "all", "dtype": "float32", "sink": sink}
                        for s in SITES]}


def read_sink(engine, root):
    """The sink's index and per-site rows, once the worker says every row is written
    (graphtap_sink_sync: partial shards out, the writer's queue empty)."""
    index = engine.collective_rpc("graphtap_sink_sync")[0]
    assert index == {"root": str(root), **json.loads((root / "index.json").read_text())}
    files = {s: [load_file(str(root / x["file"])) for x in index["shards"] if x["site"] == s]
             for s in SITES}
    return index, {s: {k: torch.cat([f[k] for f in fs]) for k in fs[0]} if fs else None
                   for s, fs in files.items()}


def test_sunk_rows_equal_per_request_captures_and_hf(engine, llama_path, sink_dir):
    from vllm import SamplingParams

    ids = tokenize(llama_path, TEXTS)
    params = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                             hooks=spec(sink=i % 2 == 0)) for i in range(len(ids))]
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = engine.generate([{"prompt_token_ids": x} for x in ids] * 2,
                           params + [plain] * len(ids), use_tqdm=False)
    sunk = [i for i in range(len(ids)) if i % 2 == 0]
    # positions run through the model: the prompt and every generated token but the last
    ran = {i: len(ids[i]) + 2 for i in range(len(ids))}
    index, rows = read_sink(engine, sink_dir)
    # the engine core's ids: vLLM appends "-" and 8 hex digits to each request's id
    requests = [r.rsplit("-", 1)[0] for r in index["requests"]]
    assert sorted(requests) == sorted(outs[i].request_id for i in sunk)
    hf = _hf_model(str(llama_path))
    for i, out in enumerate(outs[:len(ids)]):
        if i not in sunk:  # captured per request as before, in the same batch
            assert all(out.hooks[s].shape[0] == ran[i] for s in SITES)
            continue
        assert out.hooks is None or not any(s in out.hooks for s in SITES)
        full = list(ids[i]) + list(out.outputs[0].token_ids)
        ref, _, _ = hf_capture(hf, full, 1, SITES)
        solo = engine.generate([{"prompt_token_ids": ids[i]}], SamplingParams(
            max_tokens=3, temperature=0.0, ignore_eos=True, hooks=spec(False)),
            use_tqdm=False)[0]
        for s in SITES:
            mine = rows[s]["request"] == requests.index(out.request_id)
            pos = rows[s]["position"][mine]
            order = torch.argsort(pos)
            assert pos[order].tolist() == list(range(ran[i]))  # each position once
            # each row's input token, read on the device (decode tokens included)
            assert rows[s]["token_id"][mine][order].tolist() == full[:ran[i]]
            got = rows[s]["values"][mine][order]
            torch.testing.assert_close(got, solo.hooks[s], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got, ref[s][:ran[i]], rtol=1e-4, atol=1e-4)
    # plain requests of the same batch: what they generate without any hooks
    again = engine.generate([{"prompt_token_ids": x} for x in ids], plain, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[len(ids):]] == \
        [o.outputs[0].token_ids for o in again]
    assert all(x["rows"] <= 7 for x in index["shards"])  # shards of sink_shard_rows
    assert index["repeated"] == []  # no preemption here: every position ran once


def test_sink_needs_an_engine_sink():
    shape = ModelShape(num_layers=4, hidden_size=256, max_model_len=128, max_steers=2,
                       max_vectors=4, configured_sites=set(SITES))
    with pytest.raises(ValueError, match=r"hooks.capture\[0\].sink: .*sink_dir"):
        normalise(parse_spec(spec(True)), shape)
    assert normalise(parse_spec(spec(True)), shape.model_copy(update={"sink": True})) \
        .capture[0].sink


def test_a_stopped_writer_fails_sink_requests_and_the_engine_goes_on(engine, llama_path,
                                                                    sink_dir):
    """The writer stops on a failed write (a full disk; here index.json made a folder,
    so its rewrite fails). Every later sink request gets the error; a plain request of
    the same batch and later requests are untouched; graphtap_sink_sync answers with the
    error instead of raising in the worker. (Last in the module: the sink stays
    stopped.) Before, the failed put raised through vLLM's output path and the engine
    died."""
    import time

    from vllm import SamplingParams

    read_sink(engine, sink_dir)  # everything before is written
    (sink_dir / "index.json").unlink()
    (sink_dir / "index.json").mkdir()
    (sink_dir / "index.json" / "keep").write_text("")
    ids = tokenize(llama_path, TEXTS[:2])
    sink = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, hooks=spec(True))
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.generate([{"prompt_token_ids": ids[0]}], sink, use_tqdm=False)  # its shards fail
    deadline = time.monotonic() + 60
    while not engine.collective_rpc("graphtap_hook_stats")[0]["sink"]["error"]:
        assert time.monotonic() < deadline, "the writer did not stop"
        time.sleep(0.2)
    want = engine.generate([{"prompt_token_ids": ids[1]}], plain, use_tqdm=False)[0]
    outs = engine.generate([{"prompt_token_ids": ids[0]}, {"prompt_token_ids": ids[1]}],
                           [sink, plain], use_tqdm=False)
    assert "the writer stopped" in outs[0].hooks.error
    assert outs[1].outputs[0].token_ids == want.outputs[0].token_ids
    answer = engine.collective_rpc("graphtap_sink_sync")[0]
    assert "the writer stopped" in answer["error"] and answer["shards"]
    again = engine.generate([{"prompt_token_ids": ids[1]}], plain, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want.outputs[0].token_ids
