"""`graphtap::probe_resid_`: linear probes on the residual stream, on the device: for each
token row routed a probe row (ops/route*.py, like captures), its slot's entry at this
site scores it, act(<h, w_p> + b_p) for each of its P weight vectors, into the probe
buffer; guards then move P floats per token, not the hidden state. A token routed
nowhere whose entry wants its position, at or past its slot's ring_from, writes its
scores into the slot's ring instead (engine/ring.py): decode steps then
route nothing and copy nothing home.

Declared as mutating the stream tensor (left alone) so that dead-code elimination keeps
it; rows not probed go to the buffer's trash row, so the op has no data-dependent shape
and no host sync: safe inside CUDA graphs.
"""
from __future__ import annotations

from typing import Optional

import torch

from graphtap.ops.register import graph_op
from graphtap.ops.running import running_tables
from graphtap.ops.tables import ProbeTables, entry_bits


def probe_reference(t: ProbeTables, bank: torch.Tensor, tok_slot: torch.Tensor,
                    x: torch.Tensor, other: torch.Tensor | None, positions: torch.Tensor,
                    site: int) -> None:
    """Scores of x (+ other) in float32 into t.buf at the routed rows. A token's entry is
    the one of its slot at this site (a request probes each site once); tokens that
    route nowhere write the trash row, whatever their entry holds, and those of them the
    ring takes (module docstring) their slot's ring row too (the sentinel's, which
    nobody reads, for the rest: no data-dependent shape)."""
    n = x.shape[0]
    stream = x.float() if other is None else x.float() + other.float()
    slot = tok_slot[:n]
    hit = t.entry_site[slot] == site  # [n, C]: a request probes each site once
    entry = hit.int().argmax(1)  # [n]; any entry if none matches
    vec = t.entry_vec[slot, entry].long()  # [n, P]
    weights = bank[vec, :stream.shape[1]].float()  # [n, P, H]
    score = torch.einsum("nh,nph->np", stream, weights) + t.entry_bias[slot, entry]
    score = torch.where((t.entry_act[slot, entry] == 1).unsqueeze(1), torch.sigmoid(score),
                        score)
    dst = t.dst[site, :n]
    t.buf.index_copy_(0, dst, score.to(t.buf.dtype))
    pos = positions[:n].long().clamp(0, t.entry_pos.shape[2] * 32 - 1)
    wanted = entry_bits(t.entry_pos, slot, pos).gather(1, entry.unsqueeze(1)).squeeze(1)
    ring = (hit.any(1) & wanted & (dst == t.rows)
            & (pos >= t.ring_from[slot, 0]))
    where = torch.where(ring, slot, t.entry_site.shape[0] - 1)
    at = pos % t.ring_size
    t.ring.index_put_((where, entry, at), score)
    t.ring_pos.index_put_((where, entry, at), pos.to(t.ring_pos.dtype))


@graph_op("probe_resid_", mutates=("x",))
def probe_resid_(x: torch.Tensor, other: Optional[torch.Tensor], positions: torch.Tensor,
                 site: int) -> None:
    t = running_tables("probe_resid_")
    t.backend.probe(t.probe, t.steer.bank, t.tok_slot, x, other, positions, site)
