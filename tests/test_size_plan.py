"""The admission's size bound (spec/limits.py SizePlan): made once per spec, checked per
request's lengths, it gives every request the rows and bytes the per-entry passes it
replaced did, and refuses exactly where they did, with the same field in the message."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphtap.spec import normalise, parse_spec
from graphtap.spec.limits import DTYPE_BYTES, SizePlan
from graphtap.spec.positions import rule_count, rule_keys
from graphtap.spec.sites import KV_HEAD_KINDS, RESID_KINDS
from spec_strategies import valid_specs
from test_fuzz_spec import HEADS, HIDDEN, SHAPE, SITES


def reference(spec, prompt_len: int, max_tokens: int, shape) -> tuple[int, int]:
    """(rows, bytes) entry by entry, as admission computed them before the plan."""
    max_len = shape.max_model_len
    ran = max(min(prompt_len + max(max_tokens, 1) - 1, max_len), 0)
    model = DTYPE_BYTES.get(shape.dtype, 4)
    head_dim = shape.head_dim or shape.hidden_size // max(shape.num_heads, 1)
    n = lambda rule: rule_count(rule, prompt_len, max_len, 0, ran)  # noqa: E731
    rows = (sum(n(c.positions) for c in spec.capture if not c.sink) +
            sum(n(p.positions) * len(p.heads) for p in spec.pattern) +
            sum(n(p.positions) for p in spec.probe) +
            sum(n(m.positions) * len(m.heads) for m in spec.mass))
    size = 0
    for c in spec.capture:
        if c.sink:
            continue
        if c.kind in RESID_KINDS:
            width = shape.hidden_size
        else:
            heads = shape.num_kv_heads if c.kind in KV_HEAD_KINDS else shape.num_heads
            width = len(c.heads or range(heads)) * head_dim
        size += n(c.positions) * width * (4 if c.dtype == "float32" else model)
    for p in spec.pattern:
        size += rule_keys(p.positions, prompt_len, max_len, ran) * len(p.heads) * \
            (4 if p.dtype == "float32" else model)
    size += sum(n(p.positions) * len(p.vectors) * 4 for p in spec.probe)
    size += sum(n(m.positions) * len(m.heads) * len(m.spans) * 4 for m in spec.mass)
    return rows, size


PROBE_MASS = {"probe": [{"site": "blocks.1.hook_resid_post", "weights": [[1.0] * HIDDEN] * 2,
                         "positions": "generated"},
                        {"site": "blocks.2.hook_resid_pre", "weights": [[0.5] * HIDDEN],
                         "positions": [1, 3, 30]}],
              "attention_mass": [{"site": "blocks.2.attn.hook_pattern", "heads": [0, 2],
                                  "spans": [{"start": 0, "end": 4}, {"start": 4, "end": 9}],
                                  "positions": "last_prompt"}]}


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(raw=st.one_of(valid_specs(HIDDEN, SITES, HEADS, 2), st.just(PROBE_MASS)),
       prompt_len=st.integers(1, 600), max_tokens=st.integers(0, 600),
       rows_bound=st.integers(1, 400), bytes_bound=st.integers(1, 1 << 16))
def test_the_plan_counts_and_refuses_as_the_entry_passes_did(raw, prompt_len, max_tokens,
                                                            rows_bound, bytes_bound):
    shape = SHAPE.model_copy(update={"max_response_rows": rows_bound,
                                     "max_response_bytes": bytes_bound})
    spec = normalise(parse_spec(raw), shape)
    rows, size = reference(spec, prompt_len, max_tokens, shape)
    plan = SizePlan(spec, shape)
    if rows > rows_bound:
        with pytest.raises(ValueError, match=r"^hooks.capture: .* rows .*max_response_rows"):
            plan.check(prompt_len, max_tokens)
    elif size > bytes_bound:
        with pytest.raises(ValueError, match=r"^hooks.capture: .* bytes .*max_response_bytes"):
            plan.check(prompt_len, max_tokens)
    else:
        assert plan.check(prompt_len, max_tokens) == size
