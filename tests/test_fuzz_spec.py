"""Property-based fuzzing of the spec layer (issue 16): thousands of specs, valid and not,
through what the frontend runs at admission. Every spec is accepted, or refused with a
ValueError whose message starts with the field it names ("hooks..."); no other exception
ever escapes (a TypeError or RecursionError there is a 500, or worse, an engine crash),
and what is accepted is safe to run: finite float32 tables within the dtype's headroom,
positions inside the model, a wire form that round-trips."""
import math

import numpy as np
from hypothesis import HealthCheck, given, settings

from graphtap.frontend import GraphtapFrontend, HookSpecError
from graphtap.spec import ModelShape, NormalisedSpec, normalise, parse_spec
from graphtap.spec.normalise import DTYPE_MAX, HEADROOM
from graphtap.spec.salt import combined_salt
from spec_strategies import specs, valid_specs

HIDDEN, LAYERS, HEADS = 16, 4, 4
SITES = ["blocks.1.hook_resid_post", "blocks.2.hook_resid_pre", "blocks.1.attn.hook_q",
         "blocks.1.attn.hook_k", "blocks.2.attn.hook_pattern", "blocks.1.attn.hook_z"]
SHAPE = ModelShape(num_layers=LAYERS, hidden_size=HIDDEN, max_model_len=512, max_steers=3,
                   max_vectors=8, max_captures=3, configured_sites=set(SITES),
                   num_heads=HEADS, num_kv_heads=2, head_dim=HIDDEN // HEADS,
                   save_root="/nonexistent-root", dtype="bfloat16")
FUZZ = settings(max_examples=2000, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class _Params:
    def __init__(self, hooks):
        self.hooks, self.extra_args, self.max_tokens, self.n = hooks, None, 32, 1
        self.skip_reading_prefix_cache = None


def _checked(spec: NormalisedSpec) -> None:
    """What the worker will do with an accepted spec cannot go wrong."""
    limit = DTYPE_MAX["bfloat16"] * HEADROOM
    for s in spec.steer:
        v = np.frombuffer(s.vector, np.float32)
        assert v.shape == (HIDDEN,) and np.isfinite(v).all()
        assert all(math.isfinite(x) or x in (-math.inf, math.inf) for x in (s.lo, s.hi))
        assert math.isfinite(s.a) and abs(s.a) * float(np.abs(v).max()) <= limit
    for c in spec.capture + spec.pattern + spec.probe + spec.mass:
        if isinstance(c.positions, tuple):
            assert all(0 <= p < SHAPE.max_model_len for p in c.positions)
    for p in spec.probe:
        assert 1 <= len(p.vectors) == len(p.bias) <= SHAPE.probe_width
        assert all(np.isfinite(np.frombuffer(v, np.float32)).all() and len(v) == 4 * HIDDEN
                   for v in p.vectors) and all(math.isfinite(b) for b in p.bias)
    for m in spec.mass:
        assert all(0 <= sp.start < sp.end <= SHAPE.max_model_len for sp in m.spans)
        assert m.heads and all(0 <= h < HEADS for h in m.heads)
    if spec.guard is not None:
        names = {p.name for p in spec.probe} | {m.name for m in spec.mass}
        assert set(spec.guard.sources) <= names and math.isfinite(spec.guard.threshold)
    assert NormalisedSpec.from_wire(spec.to_wire()) == spec


@FUZZ
@given(specs(HIDDEN, LAYERS, HEADS))
def test_every_spec_is_accepted_or_refused_naming_its_field(raw):
    try:
        spec = normalise(parse_spec(raw), SHAPE)
    except ValueError as e:
        assert str(e).startswith("hooks"), repr(str(e))
        return
    _checked(spec)


@FUZZ
@given(specs(HIDDEN, LAYERS, HEADS))
def test_the_frontend_refuses_with_a_client_error_only(raw):
    """As vLLM's input processor calls it: HookSpecError (a 400 over HTTP), nothing else."""
    frontend = GraphtapFrontend(SHAPE)
    try:
        frontend.process_request("r", _Params(raw), None, 7)
    except HookSpecError as e:
        assert str(e).startswith("hooks"), repr(str(e))


@settings(max_examples=500, deadline=None, derandomize=True)
@given(valid_specs(HIDDEN, SITES, HEADS, 2))
def test_valid_specs_are_accepted_and_salted_stably(raw):
    spec = normalise(parse_spec(raw), SHAPE)
    _checked(spec)
    again = normalise(parse_spec(raw), SHAPE)
    assert combined_salt(None, spec, 9) == combined_salt(None, again, 9)
    assert (combined_salt(None, spec, 9) is None) == (not spec.steer)
