"""`graphtap::steer_resid_`: steer the residual stream in place, per token, from tables.

The op is opaque to torch.compile, declared as mutating its first argument (a tensor the
model uses later, so dead-code elimination keeps it), and is not a splitting op: it is
captured inside CUDA graphs. Its behaviour is entirely in the running engine's
`SteerTables`, whose addresses never change; the int `site` is baked in at trace time.
"""
from __future__ import annotations

from typing import Optional

import torch

from graphtap.ops.register import graph_op
from graphtap.ops.running import running_tables
from graphtap.ops.tables import COND_BELOW, COND_SIGMOID, COND_UNIT, SteerTables, position_bit


def steer_reference(t: SteerTables, tok_slot: torch.Tensor, x: torch.Tensor,
                    other: torch.Tensor | None, positions: torch.Tensor, site: int,
                    col: int = 0) -> None:
    """Torch implementation. The stream is x + other (x alone when other is None); the
    change is written into x. An inactive entry adds exactly zero and a row with no
    active entry is left bit for bit as it was, whatever the tables or the stream hold
    (stale inf/NaN rows, padding garbage): a product 0 * inf is NaN, so inactive values
    are selected away (torch.where), never multiplied by zero. `col`: where x's columns
    start in the vectors (this rank's heads of a z row under tensor parallelism)."""
    n = x.shape[0]
    slot = tok_slot[:n]
    pos = positions[:n].long().clamp(0, t.max_len - 1)
    stream = x.float() if other is None else x.float() + other.float()
    delta = torch.zeros_like(stream)
    touched = torch.zeros(n, dtype=torch.bool, device=x.device)
    for e in range(t.max_steers):
        active = (t.site[slot, e] == site) & position_bit(t.pos[slot, e], pos) & \
            gate_open(t, slot, e)
        vidx = t.vec[slot, e].long()
        v = t.bank[vidx, col:col + x.shape[1]].float()
        u = v * t.inv_norm[vidx].unsqueeze(1)
        coef = t.coef[slot, e]
        p = (stream * u).sum(-1)
        d = coef[:, :1] * v + (torch.clamp(p, coef[:, 1], coef[:, 2]) - p).unsqueeze(1) * u \
            + coef[:, 3:] * (v * stream)
        d = torch.where(active.unsqueeze(1), d, 0.0)
        stream = stream + d
        delta = delta + d
        touched |= active
    x.copy_(torch.where(touched.unsqueeze(1), x + delta.to(x.dtype), x))
    decide_conditions(t, slot, positions[:n].long(), stream, site)


def gate_open(t: SteerTables, slot: torch.Tensor, e: int) -> torch.Tensor:
    """Whether entry e of each token's slot may act: unconditioned, or its gate decided on."""
    return (t.cond_site[slot, e] < 0) | (t.gate[slot, e] != 0)


def decide_conditions(t: SteerTables, slot: torch.Tensor, pos: torch.Tensor,
                      stream: torch.Tensor, site: int) -> None:
    """Write the gate of every entry whose condition is scored at this site, from the row
    of its deciding position (the stream as it leaves the site's steering: what a probe
    there sees). Rows that decide nothing write into the sentinel's row, which no entry
    reads, so the write is the same for every step (no masking, no host sync)."""
    sentinel = t.site.shape[0] - 1
    for e in range(t.max_steers):
        hit = (t.cond_site[slot, e] == site) & (t.cond_pos[slot, e] == pos)
        row = t.cond_vec[slot, e].long()
        mode, coef = t.cond_mode[slot, e], t.cond_coef[slot, e]
        dot = (stream * t.bank[row, :stream.shape[1]].float()).sum(-1)
        score = torch.where((mode & COND_UNIT) != 0, dot * t.inv_norm[row], dot) + coef[:, 0]
        score = torch.where((mode & COND_SIGMOID) != 0, torch.sigmoid(score), score)
        on = torch.where((mode & COND_BELOW) != 0, score < coef[:, 1], score > coef[:, 1])
        t.gate[:, e].index_put_((torch.where(hit, slot, sentinel),), on.to(t.gate.dtype))


@graph_op("steer_resid_", mutates=("x",))
def steer_resid_(x: torch.Tensor, other: Optional[torch.Tensor], positions: torch.Tensor,
                 site: int) -> None:
    t = running_tables("steer_resid_")
    t.backend.steer(t.steer, t.tok_slot, x, other, positions, site)


@graph_op("steer_heads_", mutates=("z",))
def steer_heads_(z: torch.Tensor, site: int) -> None:
    """Steer attention heads at attn.hook_z: z [tokens, heads, head_dim] is the attention
    output o_proj reads next, edited in place as one row per token. The slot carries no
    positions: the router's copy of the step's (tok_pos) stands in."""
    t = running_tables("steer_heads_")
    n = z.shape[0]
    t.backend.steer(t.steer, t.tok_slot, z.view(n, -1), None, t.tok_pos, site,
                    t.site_cols.get(site, 0))
