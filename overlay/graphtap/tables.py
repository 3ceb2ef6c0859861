"""Routing tables for steering: fixed-address buffers allocated once, before the first
trace and any graph capture, and refilled by the scheduler before each step.

Layout (R request slots + 1 sentinel slot, E steer entries per slot, V vectors):
  tok_slot[N]          request slot of each token row; R (the sentinel) = inactive
  tok_row[N]           batch row of each token row (valid where tok_slot is active)
  ent_site[R+1, E]     site id of each entry, -1 = unused (the sentinel row stays unused)
  ent_vec[R+1, E]      row of `bank` holding the entry's vector
  ent_a/lo/hi[R+1, E]  delta = a*v + (clamp(p, lo, hi) - p) * v_hat,  p = <h, v_hat>
  ent_pos[R+1, E, W]   bitmap over positions: entry applies where bit p is set
  bank[V+1, H]         resident vectors (row 0 is zero); inv_norm[V+1] = 1/|v| (0 for row 0)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def position_bit(bitmaps: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """bitmaps [n, W] (one per token row), pos [n] -> whether each row's bit is set.
    Bit j of word w stands for position 32*w + j (scheduler.position_bitmap)."""
    word = bitmaps.gather(1, (pos >> 5).unsqueeze(1)).squeeze(1)
    return ((word >> (pos & 31)) & 1) == 1


def entry_bits(bitmaps: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """bitmaps [R+1, C, W] (per slot and entry), slot and pos [n] -> [n, C]: whether each
    token's position is set in each entry of its slot (only the one word is gathered)."""
    entries = torch.arange(bitmaps.shape[1], device=pos.device)
    word = bitmaps[slot[:, None], entries[None, :], (pos >> 5)[:, None]]
    return ((word >> (pos & 31)[:, None]) & 1) == 1


def host_to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on its way into a table row, without stalling the stream: pinned
    (caching host allocator, so safe with non_blocking) where the device is a GPU."""
    src = torch.from_numpy(arr)
    if device.type == "cuda":
        src = src.pin_memory()
    return src.to(device, non_blocking=True)


class DeviceTables:
    """Base of the fixed-address table sets: their device memory, for the start-up log."""

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in vars(self).values()
                   if isinstance(v, torch.Tensor))


class RowBuffer(DeviceTables):
    """A table set whose `buf` has one trash row after its usable rows."""

    @property
    def rows(self) -> int:
        return self.buf.shape[0] - 1


@dataclass
class SteerTables(DeviceTables):
    tok_slot: torch.Tensor
    tok_row: torch.Tensor
    ent_site: torch.Tensor
    ent_vec: torch.Tensor
    ent_a: torch.Tensor
    ent_lo: torch.Tensor
    ent_hi: torch.Tensor
    ent_pos: torch.Tensor
    bank: torch.Tensor
    inv_norm: torch.Tensor
    max_len: int

    @property
    def sentinel(self) -> int:
        return self.ent_site.shape[0] - 1

    @property
    def max_steers(self) -> int:
        return self.ent_site.shape[1]

    @classmethod
    def allocate(cls, *, max_reqs: int, max_tokens: int, max_steers: int, max_vectors: int,
                 hidden: int, max_len: int, dtype: torch.dtype, device) -> "SteerTables":
        r, e, w = max_reqs + 1, max_steers, (max_len + 31) // 32
        f32 = dict(dtype=torch.float32, device=device)
        t = cls(
            tok_slot=torch.full((max_tokens,), max_reqs, dtype=torch.int64, device=device),
            tok_row=torch.zeros((max_tokens,), dtype=torch.int64, device=device),
            ent_site=torch.full((r, e), -1, dtype=torch.int32, device=device),
            ent_vec=torch.zeros((r, e), dtype=torch.int64, device=device),
            ent_a=torch.zeros((r, e), **f32),
            ent_lo=torch.full((r, e), -torch.inf, **f32),
            ent_hi=torch.full((r, e), torch.inf, **f32),
            ent_pos=torch.zeros((r, e, w), dtype=torch.int32, device=device),
            bank=torch.zeros((max_vectors + 1, hidden), dtype=dtype, device=device),
            inv_norm=torch.zeros((max_vectors + 1,), **f32),
            max_len=max_len,
        )
        return t


ROUTE_MIN_BLOCK = 16  # smallest token block of the GPU routing kernels (route_triton.py)


@dataclass
class CaptureTables(RowBuffer):
    """Capture routing and storage (C capture entries per slot, S sites, K rows):
      cap_site[R+1, C]   site id of each entry, -1 = unused
      cap_pos[R+1, C, W] position bitmap per entry
      cap_dst[S, N]      buffer row for (site, token row) this step; K = the trash row
      buf[K+1, H]        captured rows, in the model's dtype (what vLLM itself holds: the
                         residual sum is rounded there too); row K takes everything not
                         captured. Half the bytes of float32 across PCIe, and the host
                         split is a plain copy for dtype "model" (an upcast for "float32").
      meta[K+1, 3]       (slot, site, position) of each row; slot -1 = unused row
      count[1]           rows this step wanted (more than K means overflow)
      route_flags[S, N]  scratch of the GPU routing: whether (site, token row) is wanted
      route_counts[B]    scratch of the GPU routing: wanted pairs per (site, token block)
    """

    cap_site: torch.Tensor
    cap_pos: torch.Tensor
    cap_dst: torch.Tensor
    buf: torch.Tensor
    meta: torch.Tensor
    count: torch.Tensor
    route_flags: torch.Tensor
    route_counts: torch.Tensor

    @classmethod
    def allocate(cls, *, max_reqs: int, max_tokens: int, max_captures: int, num_sites: int,
                 rows: int, hidden: int, max_len: int, device,
                 dtype: torch.dtype = torch.float32) -> "CaptureTables":
        r, w = max_reqs + 1, (max_len + 31) // 32
        i64 = dict(dtype=torch.int64, device=device)
        return cls(
            cap_site=torch.full((r, max_captures), -1, dtype=torch.int32, device=device),
            cap_pos=torch.zeros((r, max_captures, w), dtype=torch.int32, device=device),
            cap_dst=torch.full((max(num_sites, 1), max_tokens), rows, **i64),
            buf=torch.zeros((rows + 1, hidden), dtype=dtype, device=device),
            meta=torch.full((rows + 1, 3), -1, **i64),
            count=torch.zeros((1,), **i64),
            route_flags=torch.zeros((max(num_sites, 1), max_tokens), dtype=torch.int8,
                                    device=device),
            route_counts=torch.zeros((max(num_sites, 1) * -(-max_tokens // ROUTE_MIN_BLOCK),),
                                     dtype=torch.int32, device=device),
        )


@dataclass
class PatternTables(RowBuffer):
    """Attention-pattern capture (C entries per slot, Hq query heads, P rows, L keys):
      pat_site[R+1, C]      site id of each pattern entry, -1 = unused
      pat_pos[R+1, C, W]    query-position bitmap per entry
      pat_heads[R+1, C, Hq] which query heads the entry wants
      route[P+1, 6]         per step, one row per (query token, head): site (-1 = idle),
                            token row, head, batch row, position, request slot
      buf[P+1, L]           probabilities over key positions 0..position (float32)
      count[1]              rows this step wanted (more than P means overflow)
    """

    pat_site: torch.Tensor
    pat_pos: torch.Tensor
    pat_heads: torch.Tensor
    route: torch.Tensor
    buf: torch.Tensor
    count: torch.Tensor

    @classmethod
    def allocate(cls, *, max_reqs: int, max_captures: int, num_heads: int, rows: int,
                 max_len: int, device) -> "PatternTables":
        r, w = max_reqs + 1, (max_len + 31) // 32
        route = torch.zeros((rows + 1, 6), dtype=torch.int64, device=device)
        route[:, 0] = -1
        return cls(
            pat_site=torch.full((r, max_captures), -1, dtype=torch.int32, device=device),
            pat_pos=torch.zeros((r, max_captures, w), dtype=torch.int32, device=device),
            pat_heads=torch.zeros((r, max_captures, num_heads), dtype=torch.bool, device=device),
            route=route,
            buf=torch.zeros((rows + 1, max_len), dtype=torch.float32, device=device),
            count=torch.zeros((1,), dtype=torch.int64, device=device),
        )
