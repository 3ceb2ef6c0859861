"""Triton kernel for `graphtap::probe_resid_`: one program per token row, fixed launch
config. A row that neither routes nor goes to the ring costs a few loads; a probed row
is read once and scored against each of its entry's weight vectors, into its buffer row
or its slot's ring row (ops/probe.py says which)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphtap.ops.tables import ProbeTables


@triton.jit
def _probe_kernel(x_ptr, other_ptr, slot_ptr, pos_ptr, dst_ptr, site_ptr, bits_ptr, vec_ptr,
                  bias_ptr, act_ptr, from_ptr, bank_ptr, buf_ptr, ring_ptr, ring_pos_ptr,
                  H, stride_x, stride_o, stride_b, stride_buf, stride_slot,
                  TRASH, SITE, WORDS, G, HAS_OTHER: tl.constexpr,
                  C: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    dst = tl.load(dst_ptr + row)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    base = slot * stride_slot  # the slot's row of the slot block
    entry = 0
    found = False
    for e in tl.static_range(C):  # the one entry of this slot at this site
        hit = tl.load(site_ptr + base + e) == SITE
        entry = tl.where(hit, e, entry)
        found = found | hit
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + row).to(tl.int64), 0), WORDS * 32 - 1)
    word = tl.load(bits_ptr + base + entry * WORDS + pos // 32)
    wanted = ((word >> (pos % 32).to(tl.int32)) & 1) == 1
    to_ring = found & wanted & (dst == TRASH) & (pos >= tl.load(from_ptr + base))
    if (dst < TRASH) | to_ring:
        offs = tl.arange(0, BLOCK)
        m = offs < H
        s = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_OTHER:
            s += tl.load(other_ptr + row * stride_o + offs, mask=m, other=0.0).to(tl.float32)
        sigmoid = tl.load(act_ptr + base + entry) == 1
        ring_row = ((slot * C + entry) * G + pos % G)
        for p in tl.static_range(P):
            vi = tl.load(vec_ptr + base + entry * P + p).to(tl.int64)
            w = tl.load(bank_ptr + vi * stride_b + offs, mask=m, other=0.0).to(tl.float32)
            score = tl.sum(s * w, axis=0) + tl.load(bias_ptr + base + entry * P + p)
            score = tl.where(sigmoid, 1.0 / (1.0 + tl.exp(-score)), score)
            tl.store(buf_ptr + dst * stride_buf + p, score, mask=dst < TRASH)
            tl.store(ring_ptr + ring_row * P + p, score, mask=to_ring)
        tl.store(ring_pos_ptr + ring_row, pos.to(tl.int32), mask=to_ring)


def probe_triton(t: ProbeTables, bank: torch.Tensor, tok_slot: torch.Tensor, x: torch.Tensor,
                 other: torch.Tensor | None, positions: torch.Tensor, site: int) -> None:
    n, h = x.shape
    if n == 0:
        return
    # Every field is a view into the one slot block: one row stride for all of them.
    block = triton.next_power_of_2(h)
    _probe_kernel[(n,)](
        x, other if other is not None else x, tok_slot, positions, t.dst[site],
        t.entry_site, t.entry_pos, t.entry_vec, t.entry_bias, t.entry_act, t.ring_from,
        bank, t.buf, t.ring, t.ring_pos, h, x.stride(0),
        other.stride(0) if other is not None else 0, bank.stride(0), t.buf.stride(0),
        t.entry_site.stride(0), t.rows, site, t.entry_pos.shape[2], t.ring_size,
        HAS_OTHER=other is not None, C=t.entry_site.shape[1], P=t.entry_vec.shape[2],
        BLOCK=block, num_warps=4 if block <= 2048 else 8)
