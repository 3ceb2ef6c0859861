"""The frontend remembers normalised specs (GraphtapFrontend._normalised): a remembered
spec must never let through what validation refuses, nor keep a vector name's old
meaning once the registry changed."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphtap.frontend import SPEC_CACHE, SPEC_CACHE_BYTES, GraphtapFrontend, _plain
from test_spec_guards import SHAPE, _Params, steer

CAPTURE = {"capture": [{"site": "blocks.1.hook_resid_post", "positions": "last_prompt"}]}


def process(fe, hooks, prompt_len=5):
    params = _Params(hooks)
    salt = fe.process_request("r", params, None, prompt_len)
    return params.hooks, salt


def test_the_same_spec_is_normalised_once_and_gives_the_same_request():
    fe = GraphtapFrontend(SHAPE)
    first = process(fe, CAPTURE)
    assert len(fe._specs) == 1
    again = process(fe, {"capture": [dict(CAPTURE["capture"][0])]})  # equal, not the same
    assert again == first and len(fe._specs) == 1
    # the prompt length still counts per request (here the response size)
    prompt = {"capture": [{"site": "blocks.1.hook_resid_post", "positions": "prompt"}]}
    assert process(fe, prompt, prompt_len=5) != process(fe, prompt, prompt_len=9)
    assert len(fe._specs) == 2


@pytest.mark.parametrize("good, bad, field", [
    # what other encodings would merge: NaN and null (JSON), a tuple and a list, True and 1
    (steer(scale=1.0), steer(scale=math.nan), "hooks.steer[0].scale"),
    (CAPTURE, {"capture": (CAPTURE["capture"][0],)}, "hooks.capture"),
    (steer(scale=1), steer(scale=True), "hooks.steer[0].scale"),
])
def test_a_remembered_spec_never_lets_through_what_validation_refuses(good, bad, field):
    fe = GraphtapFrontend(SHAPE)
    process(fe, good)  # remembered
    for _ in range(2):
        with pytest.raises(ValueError) as e:
            process(fe, bad)
        assert str(e.value).startswith(field), str(e.value)


def test_a_vector_name_resolves_again_after_the_registry_changed():
    fe = GraphtapFrontend(SHAPE)
    named = steer(vector="calm")
    with pytest.raises(ValueError, match="calm"):
        process(fe, named)
    fe.vectors.register([fe.vectors.check("calm", np.ones(8))])
    one, _ = process(fe, named)
    fe.vectors.register([fe.vectors.check("calm", np.full(8, 2.0))])
    two, _ = process(fe, named)
    assert one != two  # the new vector's content, not the remembered one
    fe.vectors.delete("calm")
    with pytest.raises(ValueError, match="calm"):
        process(fe, named)


def test_specs_that_are_not_plain_data_are_normalised_each_time_and_the_cache_is_bounded():
    fe = GraphtapFrontend(SHAPE)
    process(fe, steer(scale=np.float32(2.0)))  # a numpy scalar: not plain
    process(fe, steer(scale=-2 ** 63 - 1))  # past what msgpack writes (test_fuzz_spec)
    assert not fe._specs
    wide = GraphtapFrontend(SHAPE.model_copy(update={"hidden_size": 8192}))
    process(wide, steer(vector=[0.5] * 8192))  # 73 KB of msgpack
    assert SPEC_CACHE_BYTES < 73 << 10 and not wide._specs
    for i in range(SPEC_CACHE + 5):
        process(fe, steer(scale=1.0 + i / 1000))
    assert len(fe._specs) == SPEC_CACHE


class _Int(int):
    pass


LEAVES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=3),
                   st.binary(max_size=2), st.builds(_Int, st.integers(0, 3)),
                   st.builds(np.float32, st.floats(width=32)))
TREES = st.recursive(LEAVES, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.tuples(kids),
    st.dictionaries(st.one_of(st.text(max_size=2), st.integers(0, 2)), kids, max_size=3)),
    max_leaves=12)


def _plain_reference(x) -> bool:
    t = type(x)
    if t in (str, int, float, bool, type(None)):
        return True
    if t is list:
        return all(_plain_reference(v) for v in x)
    if t is dict:
        return all(type(k) is str and _plain_reference(v) for k, v in x.items())
    return False


@settings(max_examples=300, deadline=None)
@given(TREES)
def test_plain_means_json_types_only_at_every_depth(tree):
    """The cache's key is only made for specs of JSON's exact types: a tuple, bytes, a
    numpy scalar, an int subclass or a non-str key anywhere keeps it out."""
    assert _plain(tree) == _plain_reference(tree)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.floats(), TREES), min_size=17, max_size=40))
def test_plain_checks_every_element_of_a_long_list(vector):
    """Lists past 16 elements (a steering vector as a JSON list) are checked by their
    elements' types gathered at once: the same answer, at any depth below them."""
    assert _plain(vector) == _plain_reference(vector)
    assert _plain({"steer": [{"vector": vector}]}) == _plain_reference(vector)


def test_clone_shares_the_spec_and_the_frontend_never_changes_it():
    """vLLM clones each request's SamplingParams before the frontend sees them (patch
    0004): the clone shares `hooks` instead of deep-copying it (a spec's float lists cost
    more to copy than the rest of admission), which is safe because the frontend
    replaces the clone's field and never changes the dict in place."""
    import copy

    from vllm import SamplingParams

    hooks = {**steer(), **CAPTURE}
    params = SamplingParams(max_tokens=4, hooks=hooks)
    before = copy.deepcopy(hooks)
    clone = params.clone()
    assert clone.hooks is params.hooks and clone is not params
    fe = GraphtapFrontend(SHAPE)
    fe.process_request("r", clone, None, 5)
    assert clone.hooks is not hooks  # normalised: a field of its own
    assert params.hooks is hooks and hooks == before
    assert SamplingParams(max_tokens=4).clone().hooks is None


@pytest.mark.parametrize("positions", ["all", "prompt", "last_prompt", [1, 3]])
def test_a_remembered_spec_salts_each_request_as_a_fresh_one(positions):
    """The steering salt is remembered with the spec, by the prompt length where its rule
    is relative to the prompt: every request gets the salt the spec's own hash gives
    (a shared prefix steered at other positions never shares KV blocks)."""
    from graphtap.spec import combined_salt, normalise, parse_spec

    fe = GraphtapFrontend(SHAPE)
    hooks = steer(positions=positions)
    for prompt_len in (5, 9, 5, 9, 7):
        _, salt = process(fe, hooks, prompt_len)
        fresh = combined_salt(None, normalise(parse_spec(hooks), SHAPE), prompt_len)
        assert salt == fresh is not None
    user = fe.process_request("r", _Params(hooks), "mine", 5)  # the user's salt still counts
    assert user == combined_salt("mine", normalise(parse_spec(hooks), SHAPE), 5)


def test_requests_of_one_spec_and_shape_share_one_wire_form():
    """A remembered spec's wire form is made once per (prompt length, max_tokens), with
    that shape's capture_bytes, and shared by its requests; a shape over the request
    limits is refused every time (never remembered); at most WIRES shapes are kept."""
    from graphtap.frontend import WIRES
    from graphtap.spec import NormalisedSpec

    shape = SHAPE.model_copy(update={"max_response_rows": 40})
    fe = GraphtapFrontend(shape)
    every = {"capture": [{"site": "blocks.1.hook_resid_post", "positions": "all"}]}
    a, b = _Params(every), _Params({"capture": [dict(every["capture"][0])]})
    fe.process_request("a", a, None, 5)
    fe.process_request("b", b, None, 5)
    assert a.hooks is b.hooks  # one wire form
    c, d = _Params(every), _Params(every, max_tokens=3)
    fe.process_request("c", c, None, 9)
    fe.process_request("d", d, None, 5)
    sizes = [NormalisedSpec.from_wire(p.hooks).capture_bytes for p in (a, c, d)]
    assert sizes[0] < sizes[1] and sizes[2] < sizes[0]  # 20, 24 and 7 rows
    for _ in range(2):
        with pytest.raises(ValueError, match="max_response_rows"):
            fe.process_request("e", _Params(every, max_tokens=40), None, 5)
    last = {"capture": [{"site": "blocks.1.hook_resid_post", "positions": "last_prompt"}]}
    for n in range(WIRES + 3):
        fe.process_request("f", _Params(last), None, 1 + n)
    assert sorted(len(wires) for *_, wires in fe._specs.values()) == [3, WIRES]


def test_a_spec_travels_as_one_bytes_value_and_arrives_whole():
    """SamplingParams.hooks after the frontend is {WIRE: the spec's msgpack}: through
    vLLM's socket encoding (the engine core's input) and a pickle (a worker in a
    process of its own) it arrives as the same spec; the plain-data form still reads."""
    import pickle

    import msgspec
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from graphtap.spec import NormalisedSpec
    from graphtap.spec.entries import WIRE

    fe = GraphtapFrontend(SHAPE)
    params = SamplingParams(max_tokens=4, hooks={**steer(vector=[0.5] * 8), **CAPTURE})
    fe.process_request("r", params, None, 5)
    assert list(params.hooks) == [WIRE] and type(params.hooks[WIRE]) is bytes
    spec = NormalisedSpec.from_wire(params.hooks)
    assert spec.steer and spec.capture and spec.capture_bytes > 0
    request = EngineCoreRequest(
        request_id="r", prompt_token_ids=[1, 2, 3, 4, 5], mm_features=None,
        sampling_params=params, pooling_params=None, arrival_time=0.0, lora_request=None,
        cache_salt=None, data_parallel_rank=None)
    arrived = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(request))
    assert NormalisedSpec.from_wire(arrived.sampling_params.hooks) == spec
    assert NormalisedSpec.from_wire(pickle.loads(pickle.dumps(params)).hooks) == spec
    # nor is a spec that skipped the frontend (plain data) read as one
    with pytest.raises(ValueError, match="hooks: the engine reads only"):
        NormalisedSpec.from_wire(msgspec.to_builtins(spec, builtin_types=(bytes,)))
    # a request cannot hand the worker a spec of its own making past validation
    for forged in ({WIRE: params.hooks[WIRE]}, {WIRE: "eA=="}):
        with pytest.raises(ValueError, match=f"hooks.{WIRE}"):
            fe.process_request("f", _Params(forged), None, 5)


def test_wire_specs_decode_each_spec_once_and_read_what_from_wire_reads():
    """WireSpecs (the hook manager's and the frontend's): equal wire bytes, which a
    burst's requests carry as bytes objects of their own after vLLM's socket, give the
    spec decoded the first time; another spec its own; what from_wire refuses it
    refuses; a large spec is decoded each time, and it keeps at most `size` specs."""
    from graphtap.spec import EMPTY, NormalisedSpec, WireSpecs
    from graphtap.spec.entries import WIRE

    fe = GraphtapFrontend(SHAPE)
    hs, _ = process(fe, CAPTURE)
    qk, _ = process(fe, {"capture": [{"site": "blocks.1.hook_resid_post",
                                      "positions": "prompt"}]})
    specs = WireSpecs(size=2, max_bytes=1 << 10)
    first = specs(hs)
    assert first == NormalisedSpec.from_wire(hs)
    assert specs({WIRE: bytes(bytearray(hs[WIRE]))}) is first  # equal bytes, not the same
    assert specs(qk) == NormalisedSpec.from_wire(qk) != first
    assert specs(None) is EMPTY and specs({}) is EMPTY
    with pytest.raises(ValueError, match="hooks: the engine reads only"):
        specs({"capture": []})
    big = WireSpecs(max_bytes=4)
    assert big(hs) == first and big(hs) is not big(hs)  # not kept: decoded each time
    specs(process(fe, {"capture": [{"site": "blocks.1.hook_resid_post",
                                    "positions": [0, 1]}]})[0])
    assert len(specs._known) == 2 and specs(hs) is not first  # the oldest went


def test_numpy_vectors_are_remembered_by_dtype_shape_and_bytes():
    """An in-process caller's numpy vector keys the cache by its dtype, shape and bytes:
    the same vector again is one entry and the same request; another value, dtype or
    shape, or the same values as a list, is an entry of its own; a vector validation
    refuses (NaN) is refused whatever came before; object arrays are never keyed."""
    fe = GraphtapFrontend(SHAPE)
    v = np.linspace(-1, 1, 8, dtype=np.float32)
    first = process(fe, steer(vector=v))
    assert len(fe._specs) == 1 and process(fe, steer(vector=v.copy())) == first
    for other in (v * 2, v.astype(np.float64), v.reshape(1, 8), v.tolist()):
        try:
            process(fe, steer(vector=other))
        except ValueError:  # a shape the field refuses: not remembered either
            pass
    keys = list(fe._specs)
    assert len(keys) == len(set(keys)) >= 4
    bad = v.copy()
    bad[3] = np.nan
    with pytest.raises(ValueError, match="vector"):
        process(fe, steer(vector=bad))
    assert not _plain(steer(vector=np.array([1.0] * 8, dtype=object)))
