"""Normalisation of a steer's condition (conditional steering): where the gate is scored,
on what vector, and whether the steer it gates can honour it."""
from __future__ import annotations

import numpy as np

from graphtap.spec.entries import ConditionEntry
from graphtap.spec.registry import VectorRegistry
from graphtap.spec.schema import Condition
from graphtap.spec.shape import ModelShape, check_float32, hidden_vector, site_of, vector_key
from graphtap.spec.sites import Site

# Where a site is in one forward pass: a layer's input, its attention (q/k/v/z), the
# stream after attention, its output.
_RANK = {"resid_pre": 0, "resid_mid": 2, "resid_post": 3}


def forward_order(site: Site) -> tuple[int, int]:
    return site.layer, _RANK.get(site.kind, 1)


# A gate is decided at the last prompt token: a gated steer acts only where it is known,
# whatever the chunking or a recompute after preemption (each re-decides it first).
GATED_POSITIONS = ("generated", "last_prompt")


def condition_entry(c: Condition, steered: Site, positions, field: str, shape: ModelShape,
                    vectors: VectorRegistry | None) -> ConditionEntry:
    site = site_of(c.site, field, shape)
    if not site.is_residual:
        raise ValueError(f"{field}.site: a condition reads the residual stream "
                         f"(hook_resid_pre|mid|post), not {site.name}")
    # The gate is written by the op at the condition's site and read by the steer's op:
    # the steer's site must come later in the forward pass, so that the tokens of one
    # step (a recompute's last prompt token and generated tokens) see it decided.
    if forward_order(site) >= forward_order(steered):
        raise ValueError(f"{field}.site: {site.name} must come before the steered site "
                         f"{steered.name} in the forward pass (the gate is decided there "
                         f"first)")
    if positions not in GATED_POSITIONS:
        raise ValueError(f"{field[:-len('.condition')]}.positions: a conditional steer "
                         f"acts once its gate is decided, at the last prompt token: use "
                         f"{' or '.join(map(repr, GATED_POSITIONS))}")
    for name in ("threshold", "bias"):
        check_float32(getattr(c, name), f"{field}.{name}")
    data = hidden_vector(c.vector, f"{field}.vector", shape, vectors)
    if c.score == "projection" and not np.frombuffer(data, np.float32).any():
        raise ValueError(f"{field}.vector: a projection needs a non-zero vector")
    return ConditionEntry(site.layer, site.kind, data, vector_key(data), float(c.threshold),
                          unit=c.score == "projection", bias=float(c.bias),
                          sigmoid=c.activation == "sigmoid", below=c.compare == "below")
