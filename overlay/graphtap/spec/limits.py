"""Bounds checked at admission, from a normalised spec and the request's lengths: rows and
bytes one request may get back (host memory in the engine core and the frontend, where a
request's rows gather until it finishes)."""
from __future__ import annotations

from graphtap.spec.entries import NormalisedSpec
from graphtap.spec.positions import rule_count, rule_keys
from graphtap.spec.sites import KV_HEAD_KINDS, RESID_KINDS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class SizePlan:
    """What a spec may return, ready for each request's lengths (check): per distinct
    position rule the rows and bytes each of its positions brings, summed over the
    entries using it, and the pattern entries' bytes per key. Made once per spec (the
    frontend keeps it with its cached spec): per request, one count per rule instead of
    a pass over every entry twice (two thirds of an hs request's admission on the dev
    CPU, and what a burst's last requests waited for at the frontend)."""

    def __init__(self, spec: NormalisedSpec, shape):
        self.shape = shape
        model = DTYPE_BYTES.get(shape.dtype, 4)
        head_dim = shape.head_dim or shape.hidden_size // max(shape.num_heads, 1)
        self.rules: dict[str, list] = {}  # repr(rule) -> [rule, rows, bytes] per position
        self.keys: list[tuple[object, int]] = []  # (pattern rule, bytes per key)
        for c in spec.capture:
            if c.sink:  # written by the worker's sink, never held for the response
                continue
            size = 4 if c.dtype == "float32" else model
            if c.kind in RESID_KINDS:
                width = shape.hidden_size
            else:
                heads = shape.num_kv_heads if c.kind in KV_HEAD_KINDS else shape.num_heads
                width = len(c.heads or range(heads)) * head_dim
            self._add(c.positions, 1, width * size)
        for p in spec.pattern:  # a row per head, each query row holding position + 1 keys
            self._add(p.positions, len(p.heads), 0)
            self.keys.append((p.positions, len(p.heads) * (4 if p.dtype == "float32"
                                                           else model)))
        for p in spec.probe:  # float32 scores
            self._add(p.positions, 1, len(p.vectors) * 4)
        for m in spec.mass:  # float32 masses per (query, head, span)
            self._add(m.positions, len(m.heads), len(m.heads) * len(m.spans) * 4)

    def _add(self, rule, rows: int, nbytes: int) -> None:
        entry = self.rules.setdefault(repr(rule), [rule, 0, 0])
        entry[1] += rows
        entry[2] += nbytes

    def check(self, prompt_len: int, max_tokens: int) -> int:
        """The request's byte estimate, or a ValueError past the per-request bounds: at
        most its rows (per entry its positions among those that run through the model,
        the prompt and every generated token but the last, times the chosen heads for
        patterns) and their bytes (row width times element size; patterns: each query
        row holds position + 1 keys)."""
        shape = self.shape
        max_len = shape.max_model_len
        ran = max(min(prompt_len + max(max_tokens, 1) - 1, max_len), 0)
        rows = size = 0
        for rule, per_rows, per_bytes in self.rules.values():
            n = rule_count(rule, prompt_len, max_len, 0, ran)
            rows += n * per_rows
            size += n * per_bytes
        if rows > shape.max_response_rows:
            raise ValueError(f"hooks.capture: this request may return {rows} rows (its "
                             f"positions x sites, pattern heads counted), more than the "
                             f"engine's {shape.max_response_rows} per request "
                             f"(hook_config.max_response_rows); capture fewer positions or "
                             f"sites, or lower max_tokens")
        for rule, per_key in self.keys:
            size += rule_keys(rule, prompt_len, max_len, ran) * per_key
        if size > shape.max_response_bytes:
            raise ValueError(f"hooks.capture: this request may return {size} bytes of "
                             f"captures, more than the engine's {shape.max_response_bytes} "
                             f"per request (hook_config.max_response_bytes)")
        return size

