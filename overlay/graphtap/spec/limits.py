"""Bounds checked at admission, from a normalised spec and the request's lengths."""
from __future__ import annotations

import numpy as np

from graphtap.spec.entries import NormalisedSpec
from graphtap.spec.positions import position_mask


def response_rows(spec: NormalisedSpec, prompt_len: int, max_tokens: int, max_len: int) -> int:
    """At most how many rows the request's captures return: per entry, its positions
    among those that run through the model (the prompt, and every generated token but the
    last), times the chosen heads for patterns."""
    ran = max(min(prompt_len + max(max_tokens, 1) - 1, max_len), 0)
    counts: dict[object, int] = {}

    def count(rule) -> int:
        key = repr(rule)
        if key not in counts:
            counts[key] = int(np.count_nonzero(position_mask(rule, prompt_len, max_len)[:ran]))
        return counts[key]

    return (sum(count(c.positions) for c in spec.capture) +
            sum(count(p.positions) * len(p.heads) for p in spec.pattern))


def check_response_rows(spec: NormalisedSpec, prompt_len: int, max_tokens: int,
                        max_len: int, bound: int) -> None:
    rows = response_rows(spec, prompt_len, max_tokens, max_len)
    if rows > bound:
        raise ValueError(f"hooks.capture: this request may return {rows} rows (its positions "
                         f"x sites, pattern heads counted), more than the engine's {bound} "
                         f"per request (hook_config.max_response_rows); capture fewer "
                         f"positions or sites, or lower max_tokens")
