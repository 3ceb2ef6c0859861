"""Per-step routing on the device: each token row's request slot (route_tokens, for every
hook), and for captures which (site, token row) pairs are wanted, the buffer row each gets
and its label (route_captures). Runs on the host's stream before the forward (not inside the
graph): it fills `cap_dst`, `meta` and `count`, which the graph's capture ops and the
courier read.

Rows are numbered site-major (every wanted token of site 0, then site 1, ...), in token
order within a site; pairs past the buffer's capacity go to the trash row and are counted,
so the courier reports the overflow instead of losing rows. Torch here (the spec of truth,
and the CPU path); on a GPU Triton kernels do the same in one launch (tokens) and two
(captures) instead of ~8 and ~35 small ops, whose launch cost made this the largest host
cost of a capturing step on the H200's host (route_triton.py). GRAPHTAP_TORCH_ROUTING=1
keeps the torch versions on GPUs too: the A/B of the kernels' gain, and a way around them.
"""
from __future__ import annotations

import functools
import os

import torch

from graphtap.tables import CaptureTables, SteerTables, entry_bits


def torch_routing() -> bool:
    """GRAPHTAP_TORCH_ROUTING=1: the torch versions on every device."""
    return os.environ.get("GRAPHTAP_TORCH_ROUTING", "") == "1"


def route_tokens(t: SteerTables, qsl: torch.Tensor, idx_mapping: torch.Tensor, n: int,
                 num_reqs: int) -> None:
    """tok_slot[:n] and tok_row[:n]: the request slot and batch row of each token row, from
    the batch's query start locations (qsl [num_reqs + 1]) and its batch row -> slot map;
    rows past the last request's tokens (padding) get the sentinel."""
    if qsl.is_cuda and not torch_routing():
        from graphtap.ops.route_triton import route_tokens_triton

        route_tokens_triton(t, qsl, idx_mapping, n, num_reqs)
        return
    route_tokens_reference(t, qsl, idx_mapping, n, num_reqs)


def route_tokens_reference(t: SteerTables, qsl: torch.Tensor, idx_mapping: torch.Tensor,
                           n: int, num_reqs: int) -> None:
    qsl = qsl[: num_reqs + 1]
    rows = _arange(t.tok_slot.shape[0], qsl.dtype, qsl.device)[:n]
    batch_row = torch.searchsorted(qsl[1:].contiguous(), rows, right=True)
    batch_row.clamp_(max=num_reqs - 1)
    slot = idx_mapping[batch_row].to(torch.int64)
    slot = torch.where(rows < qsl[num_reqs], slot, t.sentinel)
    t.tok_slot[:n].copy_(slot)
    t.tok_row[:n].copy_(batch_row)  # block-table row, for attention patterns


@functools.lru_cache(maxsize=8)
def _arange(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """0..size-1, made once per table size and device and sliced every step: no
    allocation per step (as the scheduler's own arange was before this moved here)."""
    return torch.arange(size, dtype=dtype, device=device)


def route_captures(t: CaptureTables, slot: torch.Tensor, positions: torch.Tensor,
                   max_len: int) -> None:
    """slot [n]: each token row's request slot (the sentinel: none); positions [n] (any
    integer dtype), clamped to [0, max_len) as the ops clamp them."""
    if slot.is_cuda and not torch_routing():
        from graphtap.ops.route_triton import route_triton

        route_triton(t, slot, positions, max_len)
        return
    route_reference(t, slot, positions, max_len)


def route_reference(t: CaptureTables, slot: torch.Tensor, positions: torch.Tensor,
                    max_len: int) -> None:
    n = slot.shape[0]
    pos = positions.long().clamp(0, max_len - 1)
    num_sites = t.cap_dst.shape[0]
    tokens = _arange(t.cap_dst.shape[1], torch.long, slot.device)[:n]
    # All entries at once: a fixed number of kernels per step, whatever max_captures.
    # A request names each site once, so active (site, token) pairs never collide and
    # a plain index_put_ suffices; inactive entries write into an extra, dropped row.
    # (accumulate=True would take CUDA's sort-based path every step.)
    site = t.cap_site[slot].long()  # [n, C]
    on = (site >= 0) & entry_bits(t.cap_pos, slot, pos)
    want = torch.zeros((num_sites + 1, n), dtype=torch.bool, device=slot.device)
    want.index_put_((torch.where(on, site, num_sites), tokens[:, None].expand_as(site)), on)
    flat = want[:num_sites].flatten()
    index = torch.cumsum(flat, 0) - 1
    dst = torch.where(flat & (index < t.rows), index, t.rows)
    t.cap_dst[:, :n].copy_(dst.view(num_sites, n))
    t.count.copy_(flat.sum().reshape(1))
    sites = _arange(num_sites, torch.long, slot.device).repeat_interleave(n)
    labels = torch.stack((slot.repeat(num_sites), sites, pos.repeat(num_sites)), dim=1)
    t.meta[:, 0].fill_(-1)
    t.meta.index_copy_(0, dst, labels)
