"""Vectors as packed float32 bytes ({"b64": ...}): the same entries as float lists, bad
packings refused naming the field, numpy/torch inputs packed offline, the client sends
them packed (issue 18: admission at memory speed)."""
import base64

import numpy as np
import pytest
import torch

from graphtap.spec import ModelShape, normalise, parse_spec

H = 64
SHAPE = ModelShape(num_layers=4, hidden_size=H, max_model_len=100, max_steers=3, max_vectors=8,
                   configured_sites={"blocks.1.hook_resid_post", "blocks.2.hook_resid_post"})
SITE, LATER = "blocks.1.hook_resid_post", "blocks.2.hook_resid_post"


def b64(values):
    return {"b64": base64.b64encode(np.asarray(values, "<f4").tobytes()).decode()}


def spec(vec, weights, cond):
    return {"steer": [{"site": LATER, "op": "add", "vector": vec, "scale": 2.0,
                       "positions": "generated",
                       "condition": {"site": SITE, "vector": cond, "threshold": 0.1}}],
            "probe": [{"site": SITE, "weights": weights}]}


def test_packed_equals_lists_and_arrays():
    rng = np.random.default_rng(0)
    v, w, c = (rng.normal(size=H).astype(np.float32) for _ in range(3))
    lists = normalise(parse_spec(spec(v.tolist(), [w.tolist()], c.tolist())), SHAPE)
    packed = normalise(parse_spec(spec(b64(v), [b64(w)], b64(c))), SHAPE)
    arrays = normalise(parse_spec(spec(v, np.stack([w]), torch.from_numpy(c))), SHAPE)
    assert lists == packed == arrays


@pytest.mark.parametrize("vec,words", [
    ({"b64": "not base64!"}, "not base64"),
    ({"b64": base64.b64encode(b"abc").decode()}, "3 bytes"),
    ({"b64": ""}, "0 bytes"),
    (b64([1.0, float("nan")] + [0.0] * (H - 2)), "element 1 is nan"),
    (b64([1.0] * 3), "length 3"),
    ({"b64": b64([1.0] * H)["b64"], "dtype": "f16"}, "Extra inputs"),
])
def test_bad_packings_name_the_field(vec, words):
    with pytest.raises(ValueError) as e:
        normalise(parse_spec({"steer": [{"site": SITE, "op": "add", "vector": vec}]}), SHAPE)
    assert str(e.value).startswith("hooks.steer[0].vector") and words in str(e.value), e.value


def test_client_sends_vectors_packed_and_other_arrays_as_lists():
    from graphtap.client import _jsonable

    v = np.arange(H, dtype=np.float32)
    body = _jsonable({"steer": [{"vector": v, "heads": np.array([1, 2])}],
                      "probe": [{"weights": np.stack([v, v]), "bias": np.array([0.5, 1.0])}]})
    assert body["steer"][0]["vector"] == b64(v) and body["steer"][0]["heads"] == [1, 2]
    assert body["probe"][0]["weights"] == [b64(v)] * 2 and body["probe"][0]["bias"] == [0.5, 1.0]
    assert normalise(parse_spec({"steer": [{"site": SITE, "op": "add",
                                            "vector": body["steer"][0]["vector"]}]}),
                     SHAPE).steer[0].vector == v.tobytes()
