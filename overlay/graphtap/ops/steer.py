"""`graphtap::steer_resid_`: steer the residual stream in place, per token, from tables.

The op is opaque to torch.compile, declared as mutating its first argument (a tensor the
model uses later, so dead-code elimination keeps it), and is not a splitting op: it is
captured inside CUDA graphs. Its behaviour is entirely in the bound `SteerTables`, whose
addresses never change; the int `site` is baked in at trace time.
"""
from __future__ import annotations

from typing import Optional

import torch

from graphtap.tables import SteerTables, position_bit

_tables: SteerTables | None = None
# How often the op's Python body ran. Inside a replayed CUDA graph it never runs (only its
# kernels replay), which is how the GPU check proves steering happened in graphs.
python_calls = 0


def bind_tables(tables: SteerTables | None) -> None:
    global _tables
    _tables = tables


def steer_reference(t: SteerTables, x: torch.Tensor, other: torch.Tensor | None,
                    positions: torch.Tensor, site: int) -> None:
    """Torch implementation. The stream is x + other (x alone when other is None); the
    change is written into x. Rows whose entries are all inactive get exactly +0."""
    n = x.shape[0]
    slot = t.tok_slot[:n]
    pos = positions[:n].long().clamp(0, t.max_len - 1)
    stream = x.float() if other is None else x.float() + other.float()
    delta = torch.zeros_like(stream)
    for e in range(t.max_steers):
        active = (t.ent_site[slot, e] == site) & position_bit(t.ent_pos[slot, e], pos)
        vidx = t.ent_vec[slot, e]
        v = t.bank[vidx].float()
        u = v * t.inv_norm[vidx].unsqueeze(1)
        a = torch.where(active, t.ent_a[slot, e], 0.0)
        lo = torch.where(active, t.ent_lo[slot, e], -torch.inf)
        hi = torch.where(active, t.ent_hi[slot, e], torch.inf)
        p = (stream * u).sum(-1)
        d = a.unsqueeze(1) * v + (torch.clamp(p, lo, hi) - p).unsqueeze(1) * u
        stream = stream + d
        delta = delta + d
    x.add_(delta.to(x.dtype))


@torch.library.custom_op("graphtap::steer_resid_", mutates_args=("x",))
def steer_resid_(x: torch.Tensor, other: Optional[torch.Tensor], positions: torch.Tensor,
                 site: int) -> None:
    global python_calls
    python_calls += 1
    t = _tables
    if t is None:
        return
    if x.is_cuda:
        from graphtap.ops.steer_triton import steer_triton

        steer_triton(t, x, other, positions, site)
    else:
        steer_reference(t, x, other, positions, site)


@steer_resid_.register_fake
def _(x, other, positions, site) -> None:
    return None
