"""`vllm serve --hook-manager graphtap`: steering over the OpenAI API (vllm_xargs), and
the CLI flags themselves. One server for the module."""
import json
import urllib.request

import pytest

from graphtap.testing.engines import _hf_model, tokenize
from graphtap.testing.hf_reference import hf_generate
from helpers import post, vector, vllm_server

HOOKS = {"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "scale": 6.0,
                    "vector": vector(256, 3)}]}


def test_cli_flags_reach_the_engine_config():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--hook-manager", "graphtap", "--hook-config",
                              '{"sites": ["blocks.*.hook_resid_post"], "max_vectors": 8}'])
    ea = EngineArgs.from_cli_args(args)
    assert ea.hook_manager == "graphtap" and ea.hook_config["max_vectors"] == 8


@pytest.fixture(scope="module")
def server(llama_path, tmp_path_factory):
    args = ["--hook-manager", "graphtap", "--hook-config", '{"sites": ["blocks.*.hook_resid_post"]}',
            "--enforce-eager", "--dtype", "float32", "--gpu-memory-utilization", "0.3",
            "--max-model-len", "512", "--served-model-name", "m"]
    with vllm_server(llama_path, args, tmp_path_factory.mktemp("serve") / "server.log") as base:
        yield base


def completion(base, ids, hooks=None):
    body = {"model": "m", "prompt": ids, "max_tokens": 12, "temperature": 0.0,
            "return_token_ids": True}
    if hooks is not None:
        body["vllm_xargs"] = {"hooks": json.dumps(hooks)}
    return post(base + "/v1/completions", body)


def test_steering_over_http_matches_hf(server, llama_path):
    ids = tokenize(llama_path, ["Prompt injection asks a model to ignore"])[0]
    models = json.loads(urllib.request.urlopen(server + "/v1/models").read())["data"]
    assert models
    status, plain = completion(server, ids)
    status2, steered = completion(server, ids, HOOKS)
    assert status == status2 == 200, (plain, steered)
    hf = _hf_model(str(llama_path))
    assert plain["choices"][0]["token_ids"] == hf_generate(hf, ids, 12)[0]
    assert steered["choices"][0]["token_ids"] == hf_generate(hf, ids, 12, HOOKS)[0]
    assert steered["choices"][0]["token_ids"] != plain["choices"][0]["token_ids"]


def test_bad_spec_over_http_is_a_400_naming_the_field(server, llama_path):
    ids = tokenize(llama_path, ["Numbers like 12, 40"])[0]
    bad = {"steer": [{"site": "blocks.1.hook_resid_mid", "op": "add", "vector": [1.0] * 256}]}
    status, body = completion(server, ids, bad)
    assert status == 400, body
    assert "hooks.steer[0].site" in json.dumps(body) and "hook_config.sites" in json.dumps(body)
    status, _ = completion(server, ids)
    assert status == 200
