"""`graphtap::attention_mass_`: per routed (query token, head) row, the attention weight
summed over each key span of its request's entry, computed like the pattern op (post-RoPE
q and the paged K cache, every key the attention saw) but reduced on the device: a guard
reads S floats per head, not max_model_len. Spans past a query's own position hold no
keys (causal); unused spans are (0, 0) and sum to exactly zero.
"""
from __future__ import annotations

import torch

from graphtap.ops.pattern import probabilities
from graphtap.ops.register import graph_op
from graphtap.ops.running import running_tables
from graphtap.ops.tables import KeyCache, Label, MassTables


def mass_reference(t: MassTables, q: torch.Tensor, kc: KeyCache, site: int) -> None:
    """Torch implementation: the pattern reference's probabilities per position group,
    each row's summed over its entry's spans."""
    for rows, p, probs in probabilities(t, q, kc, site):
        slot = t.labels[rows, Label.SLOT]
        entry = (t.entry_site[slot] == site).int().argmax(1)
        spans = t.entry_spans[slot, entry].long()  # [rows, S, 2]
        j = torch.arange(p + 1, device=q.device)
        inside = (j[None, None, :] >= spans[..., :1]) & (j[None, None, :] < spans[..., 1:])
        t.buf[rows] = (probs[:, None, :] * inside).sum(-1)


@graph_op("attention_mass_", mutates=("sink",))
def attention_mass_(sink: torch.Tensor, q: torch.Tensor, site: int) -> None:
    """`sink` is the attention output, declared mutated and left alone (dead-code
    elimination keeps the op); q is [tokens, heads, dim]."""
    t = running_tables("attention_mass_")
    kc = t.key_caches.get(site)
    if t.mass is None or kc is None:  # the profiling run, before the cache exists
        return
    t.backend.mass(t.mass, q, kc, site)
