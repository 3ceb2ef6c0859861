"""The spec layer refuses what would harm other requests or be read as something else
(issue 16, items 1, 4, 6, 8, 9), without an engine."""
import math

import numpy as np
import pytest

from graphtap.frontend import GraphtapFrontend
from graphtap.spec import ModelShape, NormalisedSpec, normalise, parse_spec
from graphtap.spec.salt import combined_salt

SHAPE = ModelShape(num_layers=4, hidden_size=8, max_model_len=64, max_steers=3, max_vectors=4,
                   configured_sites={"blocks.1.hook_resid_post", "blocks.2.hook_resid_post",
                                     "blocks.1.attn.hook_q", "blocks.1.attn.hook_pattern"},
                   num_heads=2, num_kv_heads=2, save_root="/tmp", dtype="bfloat16")


def steer(**kw):
    return {"steer": [{"site": "blocks.1.hook_resid_post", "op": "add", "vector": [1.0] * 8,
                       **kw}]}


def refused(spec, field, words=""):
    with pytest.raises(ValueError) as e:
        normalise(parse_spec(spec), SHAPE)
    assert str(e.value).startswith(field), str(e.value)
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("kw, field", [
    (dict(scale=1e300), "hooks.steer[0].scale"),  # finite in float64, inf in the tables
    (dict(scale=-3.5e38), "hooks.steer[0].scale"),
    (dict(op="set_projection", target=1e39), "hooks.steer[0].target"),
    (dict(op="clamp", min=-1e300, max=1.0), "hooks.steer[0].min"),
    (dict(scale=1e38), "hooks.steer[0]"),  # finite, but the stream would overflow
    (dict(vector=[3.398e38] * 8), "hooks.steer[0].vector"),  # finite in float32, inf in bf16
])
def test_values_that_overflow_downstream_are_refused_at_admission(kw, field):
    refused(steer(**kw), field)


@pytest.mark.parametrize("spec, field", [
    (steer(scale=True), "hooks.steer[0].scale"),
    (steer(scale="2.5"), "hooks.steer[0].scale"),
    (steer(vector=[True] * 8), "hooks.steer[0].vector"),
    (steer(vector=["1.0"] * 8), "hooks.steer[0].vector"),
    (steer(positions={"start": True, "end": 4}), "hooks.steer[0].positions"),
    (steer(positions={"start": "1", "end": 4}), "hooks.steer[0].positions"),
    ({"capture": [{"site": "blocks.1.attn.hook_q", "heads": [True]}]}, "hooks.capture[0].heads"),
    ({"capture": [{"site": "blocks.1.attn.hook_q", "heads": ["1"]}]}, "hooks.capture[0].heads"),
    ({"capture": [{"site": "blocks.1.attn.hook_q", "heads": [1.0]}]}, "hooks.capture[0].heads"),
])
def test_bools_and_numeric_strings_are_not_numbers(spec, field):
    refused(spec, field)


@pytest.mark.parametrize("site", ["blocks.\u0661.hook_resid_post", "blocks.01.hook_resid_post",
                                  "blocks.1.hook_resid_post\n", " blocks.1.hook_resid_post",
                                  "blocks.1.hook_resid_post ", "blocks.+1.hook_resid_post"])
def test_site_names_are_spelled_one_way(site):
    refused({"steer": [{"site": site, "op": "add", "vector": [1.0] * 8}]},
            "hooks.steer[0].site", "unknown site")


@pytest.mark.parametrize("save_to", ["~", "~/x", "a/../../b", "/etc", "", "a//b", ".", "a/./b",
                                     "x" * 300, "a\nb", "ok/" * 20 + "deep"])
def test_save_to_is_a_plain_relative_folder_name(save_to):
    refused({"capture": [{"site": "blocks.1.attn.hook_q"}], "save_to": save_to},
            "hooks.save_to")


def test_numpy_values_still_count_as_numbers():
    spec = normalise(parse_spec(steer(vector=np.ones(8, np.float32), scale=np.float32(2.0))),
                     SHAPE)
    assert spec.steer[0].a == 2.0


@pytest.mark.parametrize("positions", ["prompt", "generated", "last_prompt"])
def test_relative_position_rules_salt_with_the_prompt_length(positions):
    """A rule relative to the prompt steers different positions for prompts of different
    lengths, so their shared prefix blocks hold different KV: one salt would let one
    read the other's."""
    spec = normalise(parse_spec(steer(positions=positions)), SHAPE)
    assert combined_salt(None, spec, 5) != combined_salt(None, spec, 6)
    absolute = normalise(parse_spec(steer(positions=[1, 2])), SHAPE)
    assert combined_salt(None, absolute, 5) == combined_salt(None, absolute, 6)


def test_no_user_salt_can_reach_a_steered_request_s_blocks():
    spec = normalise(parse_spec(steer()), SHAPE)
    steered = combined_salt(None, spec, 5)
    plain = NormalisedSpec()
    # a plain request that sends the steered request's salt (or anything else) as its own
    for user in (steered, steered.split("|")[-1], "graphtap:" + steered, "x", None):
        assert combined_salt(user, plain, 5) != steered
    assert combined_salt("x", spec, 5) != combined_salt("y", spec, 5)  # the user's still counts
    assert combined_salt(None, plain, 5) is None  # a plain request without a salt: stock


class _Params:
    def __init__(self, hooks, max_tokens=16):
        self.hooks, self.extra_args, self.max_tokens = hooks, None, max_tokens


class _Request:
    def __init__(self, rid, params):
        self.request_id, self.sampling_params = rid, params


def test_byte_budgets_per_request_and_per_server():
    shape = SHAPE.model_copy(update={"max_response_bytes": 1000, "max_live_capture_bytes": 3000})
    fe = GraphtapFrontend(shape)
    one_site = {"capture": [{"site": "blocks.1.hook_resid_post"}]}  # bf16 rows of 8: 16 B each
    fe.process_request("r", _Params(one_site, max_tokens=40), None, 10)  # 49 rows: 784 B
    with pytest.raises(ValueError, match=r"hooks.capture: .* bytes .*max_response_bytes"):
        fe.process_request("r", _Params(one_site, max_tokens=200), None, 10)  # 64 rows: 1024 B
    admitted = []
    for i in range(5):
        p = _Params(one_site, max_tokens=40)
        fe.process_request(f"r{i}", p, None, 10)
        try:
            fe.admit_request(_Request(f"r{i}", p))
            admitted.append(i)
        except ValueError as e:
            assert "hook_config.max_live_capture_bytes" in str(e)
    assert admitted == [0, 1, 2]  # 3 x 784 B fit in 3000 B, a fourth does not
    fe.release_request("r0")
    p = _Params(one_site, max_tokens=40)
    fe.process_request("r9", p, None, 10)
    fe.admit_request(_Request("r9", p))  # room again


def test_api_servers_share_the_resident_vector_table():
    """Each of N API server processes admits at most 1/N of the worker's table, so
    together they never overflow it (the worker raised and the engine died)."""
    fe = GraphtapFrontend(SHAPE)
    fe.api_servers = 2  # max_vectors 4: 2 each
    specs = [steer(vector=[float(i + 1)] * 8) for i in range(3)]
    for i, spec in enumerate(specs[:2]):
        p = _Params(spec)
        fe.process_request(f"r{i}", p, None, 4)
        fe.admit_request(_Request(f"r{i}", p))
    p = _Params(specs[2])
    fe.process_request("r2", p, None, 4)
    with pytest.raises(ValueError, match=r"2 of the 2 slots this API server may hold"):
        fe.admit_request(_Request("r2", p))


def test_frontend_namespaces_a_plain_request_s_salt():
    """Item 4 as the frontend runs it: the plain request's own salt, the steered salt
    verbatim, must not come back as the steered request's salt."""
    fe = GraphtapFrontend(SHAPE)
    steered = fe.process_request("s", _Params(steer()), None, 5)
    assert fe.process_request("p", _Params(None), steered, 5) != steered
    assert fe.process_request("p", _Params(None), None, 5) is None


def _vllm_config(arch="LlamaForCausalLM", pp=1, tp=1, spec=None, heads=4, kv=2):
    from types import SimpleNamespace as NS

    return NS(model_config=NS(architectures=[arch], hf_text_config=NS(num_hidden_layers=4),
                              model_arch_config=NS(total_num_attention_heads=heads),
                              get_total_num_kv_heads=lambda: kv),
              parallel_config=NS(pipeline_parallel_size=pp, tensor_parallel_size=tp),
              speculative_config=spec)


@pytest.mark.parametrize("kw, words", [
    (dict(arch="GPT2LMHeadModel"), "GPT2LMHeadModel has no hook slots"),
    (dict(pp=2), "pipeline_parallel_size > 1"),
    (dict(spec=object()), "speculative decoding"),
    (dict(tp=4, kv=3), "3 KV heads do not split over tensor_parallel_size=4"),
    (dict(tp=3), "4 query heads and 2 KV heads do not split"),
])
def test_engines_graphtap_cannot_honour_do_not_start(kw, words):
    """Item 3: any combination that would run requests unhooked, or return rows of
    rejected drafts as theirs, is refused when the engine starts."""
    from graphtap.config import load_hook_config
    from graphtap.support import refuse_unsupported

    config = load_hook_config({"sites": ["blocks.1.attn.hook_q", "blocks.1.hook_resid_post"]})
    with pytest.raises(ValueError, match=words):
        refuse_unsupported(_vllm_config(**kw), config)
    refuse_unsupported(_vllm_config(), config)  # a plain Llama engine starts
    refuse_unsupported(_vllm_config(tp=2), config)  # heads split over ranks (engine/heads)
    refuse_unsupported(_vllm_config(tp=4), config)  # KV heads replicated on 2 ranks each
    refuse_unsupported(_vllm_config(tp=3), load_hook_config({}))  # residual sites: any TP
