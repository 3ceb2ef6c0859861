"""`graphtap harvest` (graphtap/harvest.py) on the tiny Llama, one engine with a bulk
sink: every prompt's rows once, labelled by prompt, position and token, equal to the
per-request capture of the same prompt and to HF's residual stream; the sink and the
per-request transport write the same bytes; an interrupted harvest resumes to the same
files; a directory holding another harvest is refused; bad datasets name the line."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from graphtap.harvest import harvest, read_dataset
from graphtap.testing.engines import _hf_model, make_llm, shutdown, tokenize
from graphtap.testing.hf_reference import hf_capture
from safetensors.torch import load_file

SITES = ["blocks.1.hook_resid_mid", "blocks.3.hook_resid_post"]
TEXTS = ["The quick brown fox", "Steering vectors shift the hidden state",
         "Prompt injection asks a model", "Numbers like 12, 40", "Hallucination probes"]


@pytest.fixture(scope="module")
def engine(llama_path, tmp_path_factory):
    llm = make_llm(llama_path, hook_manager="graphtap", hook_config={
        "sites": SITES, "sink_dir": str(tmp_path_factory.mktemp("sink")),
        "sink_shard_rows": 5})  # small shards: a run's rows span several
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def prompts(llama_path):
    ids = tokenize(llama_path, TEXTS[3:])
    return TEXTS[:3] + ids  # strings and token id lists alike


def shards(out):
    manifest = json.loads((out / "manifest.json").read_text())
    return manifest, [load_file(str(out / s["file"])) for s in manifest["shards"]]


def test_rows_come_once_labelled_and_equal_captures_and_hf(engine, prompts, llama_path,
                                                           tmp_path):
    manifest = harvest(engine, prompts, SITES, tmp_path, shard_prompts=2, progress=False)
    assert manifest["complete"] and len(manifest["shards"]) == 3
    manifest, files = shards(tmp_path)
    joined = {k: torch.cat([f[k] for f in files]) for k in files[0]}
    assert manifest["rows"] == len(joined["position"])
    ids = [tokenize(llama_path, [p])[0] if isinstance(p, str) else p for p in prompts]
    # every (prompt, position) once, in order
    want = [(i, p) for i, x in enumerate(ids) for p in range(len(x))]
    assert list(zip(joined["prompt_index"].tolist(), joined["position"].tolist())) == want
    assert joined["token_id"].tolist() == [t for x in ids for t in x]
    from vllm import SamplingParams

    spec = {"capture": [{"site": s, "positions": "all", "dtype": "float32"} for s in SITES]}
    hf = _hf_model(str(llama_path))
    for i, x in enumerate(ids):
        mine = joined["prompt_index"] == i
        solo = engine.generate([{"prompt_token_ids": x}], SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True, hooks=spec), use_tqdm=False)[0]
        ref, _, _ = hf_capture(hf, x, 1, SITES)
        for s in SITES:
            torch.testing.assert_close(joined[s][mine], solo.hooks[s], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(joined[s][mine], ref[s][:len(x)], rtol=1e-4, atol=1e-4)


def test_the_sink_and_the_per_request_path_write_the_same_bytes(engine, prompts, tmp_path):
    """The rows through the sink (never in a RequestOutput) make the same files as the
    same prompts captured per request; the sink's files are gone once read."""
    via_sink = harvest(engine, prompts, SITES, tmp_path / "sink", shard_prompts=2,
                       progress=False, sink=True)
    per_request = harvest(engine, prompts, SITES, tmp_path / "request", shard_prompts=2,
                          progress=False, sink=False)
    assert [s["sha256"] for s in via_sink["shards"]] == \
        [s["sha256"] for s in per_request["shards"]]
    index = engine.collective_rpc("graphtap_sink_sync")[0]
    assert index["shards"] and not list(Path(index["root"]).rglob("*.safetensors"))
    # dtype "model" (the engine's own, float32 on this CPU) through the sink as well
    a = harvest(engine, prompts[:2], SITES, tmp_path / "ms", dtype="model", progress=False)
    b = harvest(engine, prompts[:2], SITES, tmp_path / "mr", dtype="model", progress=False,
                sink=False)
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]


def test_an_interrupted_harvest_resumes_to_the_same_files(engine, prompts, tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    harvest(engine, prompts, SITES, whole, shard_prompts=2, progress=False)
    first = harvest(engine, prompts, SITES, part, shard_prompts=2, stop_after=1,
                    progress=False)
    assert not first["complete"] and len(first["shards"]) == 1
    (part / "shard-00001.safetensors").write_bytes(b"torn")  # a shard cut short, unlisted
    again = harvest(engine, prompts, SITES, part, shard_prompts=2, progress=False)
    assert again["complete"]
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (whole, part))
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]
    # a listed shard whose bytes changed is made again, not trusted
    (part / "shard-00000.safetensors").write_bytes(b"x")
    fixed = harvest(engine, prompts, SITES, part, shard_prompts=2, progress=False)
    assert [s["sha256"] for s in fixed["shards"]] == [s["sha256"] for s in a["shards"]]


def test_a_directory_holding_another_harvest_is_refused(engine, prompts, tmp_path):
    harvest(engine, prompts[:2], SITES, tmp_path, shard_prompts=2, progress=False)
    with pytest.raises(ValueError, match="holds a different harvest"):
        harvest(engine, prompts[:2], SITES[:1], tmp_path, shard_prompts=2, progress=False)


def test_bad_datasets_name_the_line(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a"}\n\n{"prompt_token_ids": [1, 2]}\n{"text": "b"}\n')
    assert read_dataset(good) == ["a", [1, 2], "b"]
    for text, words in [('{"prompt": "a"}\nnope\n', ":2: not JSON"),
                        ('{"prompt": ""}\n', ":1: expected"),
                        ('{"prompt_token_ids": ["x"]}\n', ":1: expected"), ("\n", "no prompts")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(ValueError, match=words):
            read_dataset(bad)
    res = subprocess.run([sys.executable, "-m", "graphtap.cli", "harvest", "m", "--dataset",
                          str(bad), "--sites", SITES[0], "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "no prompts" in res.stderr  # before any engine starts
    assert not np.any([p.name == "o" for p in tmp_path.iterdir()])


def test_hugging_face_datasets_are_read_by_column_and_split(tmp_path):
    """--dataset also takes a Hugging Face dataset (a save_to_disk folder here; a hub
    NAME[:SPLIT] goes through the same datasets call): its prompt, text or
    prompt_token_ids column, or the one --column names; errors name the source."""
    import datasets

    one = tmp_path / "one"
    datasets.Dataset.from_dict({"id": [1, 2], "text": ["a", "b"]}).save_to_disk(str(one))
    assert read_dataset(str(one)) == ["a", "b"]
    both = tmp_path / "both"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"prompt_token_ids": [[1, 2], [3]]}),
        "test": datasets.Dataset.from_dict({"body": ["x", "y", "z"]})}).save_to_disk(str(both))
    assert read_dataset(str(both)) == [[1, 2], [3]]
    assert read_dataset(f"{both}:test", column="body") == ["x", "y", "z"]
    for source, column, words in [(f"{both}:test", None, "no column prompt or text"),
                                  (f"{both}:dev", None, "no split 'dev'"),
                                  (str(one), "body", "no column body"),
                                  (str(tmp_path / "absent"), None, "not a JSONL file")]:
        with pytest.raises(ValueError, match=words):
            read_dataset(source, column)
    empty = tmp_path / "empty"
    datasets.Dataset.from_dict({"text": ["a", ""]}).save_to_disk(str(empty))
    with pytest.raises(ValueError, match=r"empty\[1\]: expected a non-empty"):
        read_dataset(str(empty))


def test_the_same_rows_make_the_same_bytes(tmp_path):
    """A shard's bytes depend on its rows only (the manifest's sha256 checks resumed
    shards against them): safetensors wrote several metadata keys in a varying order,
    so a resumed harvest's identical shard once hashed differently."""
    from graphtap.harvest import _write

    tensors = {"blocks.1.hook_resid_mid": torch.randn(7, 16), "position": torch.arange(7),
               "prompt_index": torch.zeros(7, dtype=torch.int64),
               "token_id": torch.arange(7) + 3}
    hashes = set()
    for i in range(20):
        (tmp_path / str(i)).mkdir()
        hashes.add(_write(tmp_path / str(i), 3, (6, 8), tensors)["sha256"])
    assert len(hashes) == 1
