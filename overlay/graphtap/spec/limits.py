"""Bounds checked at admission, from a normalised spec and the request's lengths: rows and
bytes one request may get back (host memory in the engine core and the frontend, where a
request's rows gather until it finishes)."""
from __future__ import annotations

from graphtap.spec.entries import NormalisedSpec
from graphtap.spec.positions import rule_count, rule_keys
from graphtap.spec.sites import KV_HEAD_KINDS, RESID_KINDS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def response_rows(spec: NormalisedSpec, prompt_len: int, max_tokens: int, max_len: int) -> int:
    """At most how many rows the request's captures return: per entry, its positions
    among those that run through the model (the prompt, and every generated token but the
    last), times the chosen heads for patterns."""
    ran = max(min(prompt_len + max(max_tokens, 1) - 1, max_len), 0)
    counts: dict[object, int] = {}

    def count(rule) -> int:
        key = repr(rule)
        if key not in counts:
            counts[key] = _ran(rule, prompt_len, max_len, ran)
        return counts[key]

    return (sum(count(c.positions) for c in spec.capture if not c.sink) +
            sum(count(p.positions) * len(p.heads) for p in spec.pattern) +
            sum(count(p.positions) for p in spec.probe) +
            sum(count(m.positions) * len(m.heads) for m in spec.mass))


def _ran(rule, prompt_len: int, max_len: int, ran: int) -> int:
    """The rule's positions among the first `ran` (those that run through the model)."""
    return rule_count(rule, prompt_len, max_len, 0, ran)


def check_response_rows(spec: NormalisedSpec, prompt_len: int, max_tokens: int,
                        max_len: int, bound: int) -> None:
    rows = response_rows(spec, prompt_len, max_tokens, max_len)
    if rows > bound:
        raise ValueError(f"hooks.capture: this request may return {rows} rows (its positions "
                         f"x sites, pattern heads counted), more than the engine's {bound} "
                         f"per request (hook_config.max_response_rows); capture fewer "
                         f"positions or sites, or lower max_tokens")


def response_bytes(spec: NormalisedSpec, prompt_len: int, max_tokens: int, shape) -> int:
    """At most how many bytes the request's captures hold: rows times row width times
    element size (patterns: each query row holds position + 1 keys)."""
    max_len = shape.max_model_len
    ran = max(min(prompt_len + max(max_tokens, 1) - 1, max_len), 0)
    model = DTYPE_BYTES.get(shape.dtype, 4)
    head_dim = shape.head_dim or shape.hidden_size // max(shape.num_heads, 1)
    total = 0
    for c in spec.capture:
        if c.sink:  # written by the worker's sink, never held for the response
            continue
        size = 4 if c.dtype == "float32" else model
        if c.kind in RESID_KINDS:
            width = shape.hidden_size
        else:
            heads = shape.num_kv_heads if c.kind in KV_HEAD_KINDS else shape.num_heads
            width = len(c.heads or range(heads)) * head_dim
        total += _ran(c.positions, prompt_len, max_len, ran) * width * size
    for p in spec.pattern:
        size = 4 if p.dtype == "float32" else model
        total += rule_keys(p.positions, prompt_len, max_len, ran) * len(p.heads) * size
    for p in spec.probe:  # float32 scores
        total += _ran(p.positions, prompt_len, max_len, ran) * len(p.vectors) * 4
    for m in spec.mass:  # float32 masses per (query, head, span)
        total += _ran(m.positions, prompt_len, max_len, ran) * len(m.heads) * len(m.spans) * 4
    return total


def check_response_size(spec: NormalisedSpec, prompt_len: int, max_tokens: int, shape) -> int:
    """The request's byte estimate, or a ValueError past the per-request budget."""
    check_response_rows(spec, prompt_len, max_tokens, shape.max_model_len,
                        shape.max_response_rows)
    size = response_bytes(spec, prompt_len, max_tokens, shape)
    if size > shape.max_response_bytes:
        raise ValueError(f"hooks.capture: this request may return {size} bytes of captures, "
                         f"more than the engine's {shape.max_response_bytes} per request "
                         f"(hook_config.max_response_bytes)")
    return size
