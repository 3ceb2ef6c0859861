"""Hypothesis strategies for hook specs, valid and not (the fuzzers: test_fuzz_spec.py
against the spec layer, test_serve_api.py against a server).

`specs(hidden, layers, sites)` draws mostly-plausible specs: the right keys with values
that are sometimes wrong in every way a client gets them wrong (types, ranges, spellings,
sizes, nesting, unknown keys), so that most draws reach deep into validation instead of
failing at the first key."""
from __future__ import annotations

from hypothesis import strategies as st

KINDS = ["hook_resid_pre", "hook_resid_mid", "hook_resid_post", "attn.hook_q", "attn.hook_k",
         "attn.hook_v", "attn.hook_z", "attn.hook_pattern"]

junk = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) |
    st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=12)


def numbers():
    return st.one_of(st.floats(-1e3, 1e3, allow_nan=False), st.integers(-5, 5),
                     st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
                         [1e300, -1e300, 3.5e38, 1e38, True, "2.5", None]))


def site_names(layers: int):
    layer = st.one_of(st.integers(0, layers - 1).map(str), st.sampled_from(
        ["-1", str(layers), "01", "*", "\u0661", "1 ", "x", str(10 ** 30)]))
    return st.one_of(
        st.tuples(layer, st.sampled_from(KINDS + ["hook_attn_q", "attn.hook_nope"])).map(
            lambda t: f"blocks.{t[0]}.{t[1]}"),
        st.sampled_from(["", "blocks.1.hook_resid_post\n", "BLOCKS.1.hook_resid_post"]),
        junk)


def positions():
    return st.one_of(
        st.sampled_from(["all", "prompt", "generated", "last_prompt", "middle", ""]),
        st.lists(st.integers(-3, 600), max_size=6),
        st.fixed_dictionaries({"start": st.integers(-2, 600), "end": st.integers(-2, 600)}),
        st.fixed_dictionaries({"start": st.sampled_from([True, "1", 1.5, 0])},
                              optional={"end": st.integers(0, 10)}),
        junk)


def vectors(hidden: int):
    return st.one_of(
        st.lists(st.floats(-4, 4, allow_nan=False, width=32), min_size=hidden,
                 max_size=hidden),
        st.lists(numbers(), min_size=hidden, max_size=hidden),
        st.lists(st.floats(-4, 4, allow_nan=False), max_size=hidden + 3),
        st.sampled_from(["unregistered-name", ""]), junk)


def steers(hidden: int, layers: int):
    return st.fixed_dictionaries(
        {"site": site_names(layers),
         "op": st.sampled_from(["add", "set_projection", "ablate", "clamp", "scale", "spin",
                                1])},
        optional={"vector": vectors(hidden), "scale": numbers(), "target": numbers(),
                  "min": numbers(), "max": numbers(), "positions": positions(),
                  "heads": st.one_of(st.lists(st.integers(-1, 9), max_size=5), junk),
                  "colour": junk})


def probes(hidden: int, layers: int):
    return st.fixed_dictionaries(
        {"site": site_names(layers),
         "weights": st.one_of(st.lists(vectors(hidden), max_size=3), junk)},
        optional={"bias": st.one_of(st.lists(numbers(), max_size=3), junk),
                  "activation": st.sampled_from(["none", "sigmoid", "relu", 0]),
                  "positions": positions()})


def masses(layers: int, heads: int):
    span = st.one_of(st.fixed_dictionaries({"start": st.integers(-2, 600),
                                            "end": st.integers(-2, 600)}), junk)
    return st.fixed_dictionaries(
        {"site": site_names(layers), "spans": st.one_of(st.lists(span, max_size=10), junk)},
        optional={"heads": st.one_of(st.lists(st.integers(-1, heads), max_size=heads + 1),
                                     junk),
                  "positions": positions()})


def guards(layers: int):
    return st.one_of(st.fixed_dictionaries(
        {"kind": st.sampled_from(["attention_focus", "probe", "vibes"]),
         "threshold": numbers()},
        optional={"action": st.sampled_from(["annotate", "stop", "kill"]),
                  "site": site_names(layers), "column": st.integers(-1, 4)}), junk)


def captures(layers: int, heads: int):
    return st.fixed_dictionaries(
        {"site": site_names(layers)},
        optional={"positions": positions(),
                  "heads": st.one_of(st.lists(st.integers(-1, heads), max_size=heads + 1),
                                     junk),
                  "dtype": st.sampled_from(["model", "float32", "int8", 3]),
                  "extra": junk})


def specs(hidden: int, layers: int, heads: int):
    return st.one_of(
        st.fixed_dictionaries({}, optional={
            "steer": st.lists(steers(hidden, layers), max_size=4) | junk,
            "capture": st.lists(captures(layers, heads), max_size=4) | junk,
            "probe": st.lists(probes(hidden, layers), max_size=3) | junk,
            "attention_mass": st.lists(masses(layers, heads), max_size=3) | junk,
            "guard": guards(layers),
            "save_to": st.sampled_from(["run", "a/b", "~", "../x", "/etc", "", "x" * 70]),
            "encoding": st.sampled_from(["raw", "safetensors", "pickle"]),
            "other": junk}),
        junk)


def valid_specs(hidden: int, sites: list[str], heads: int, kv_heads: int):
    """Specs the engine must accept (sites: configured residual and attention sites)."""
    residual = [s for s in sites if "resid" in s]
    rule = st.one_of(st.sampled_from(["all", "prompt", "generated", "last_prompt"]),
                     st.lists(st.integers(0, 40), min_size=1, max_size=4, unique=True),
                     st.integers(0, 20).flatmap(lambda a: st.fixed_dictionaries(
                         {"start": st.just(a), "end": st.integers(a + 1, a + 30)})))
    steer = st.fixed_dictionaries(
        {"site": st.sampled_from(residual), "op": st.sampled_from(["add", "ablate"]),
         "vector": st.lists(st.floats(-2, 2, allow_nan=False, width=32), min_size=hidden,
                            max_size=hidden).map(lambda v: [1.0] + v[1:] if not any(v) else v)},
        optional={"scale": st.floats(-8, 8, allow_nan=False), "positions": rule})
    capture = st.sampled_from(sites).flatmap(lambda site: st.fixed_dictionaries(
        {"site": st.just(site)},
        optional={"positions": rule, "dtype": st.sampled_from(["model", "float32"]),
                  **({"heads": st.lists(st.integers(0, _heads(site, heads, kv_heads) - 1),
                                        min_size=1, max_size=heads, unique=True)}
                     if "attn" in site else {})}))
    return st.fixed_dictionaries({}, optional={
        "steer": st.lists(steer, max_size=2),
        "capture": st.lists(capture, max_size=3, unique_by=lambda c: c["site"])})


def _heads(site: str, heads: int, kv_heads: int) -> int:
    return kv_heads if site.endswith(("hook_k", "hook_v")) else heads
