"""Triton kernel for `graphtap::steer_resid_`: one program per token row, fixed launch
config (no autotune: nothing may be tuned or compiled differently inside a capture).

Inactive rows cost a handful of scalar loads: the entry pass that decides whether any
entry applies reads only the entry's site, one bitmap word and its condition's site and
position; the row itself is read only when an entry applies or a condition is decided
at this row, and written only when one applies, so unsteered rows are never touched.
A conditional entry's gate is stored by the program of its deciding row, at the
condition's site, which always precedes the steered site (spec/condition.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphtap.ops.tables import SteerTables


@triton.jit
def _steer_kernel(x_ptr, other_ptr, pos_ptr, slot_ptr, site_ptr, vec_ptr, coef_ptr,
                  posbits_ptr, bank_ptr, inv_ptr, csite_ptr, cvec_ptr, cmode_ptr, ccoef_ptr,
                  cpos_ptr, gate_ptr, H, stride_x, stride_o, stride_b, stride_slot,
                  W, max_len, SITE, HAS_OTHER: tl.constexpr, E: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    raw_pos = tl.load(pos_ptr + row).to(tl.int32)
    pos = tl.minimum(tl.maximum(raw_pos, 0), max_len - 1)
    entries = slot * stride_slot  # the slot's row of the slot block (every view shares it)
    hits = 0
    decides = 0
    for e in tl.static_range(E):
        word = tl.load(posbits_ptr + entries + e * W + pos // 32)
        on = (tl.load(site_ptr + entries + e) == SITE) & (((word >> (pos % 32)) & 1) == 1)
        cs = tl.load(csite_ptr + entries + e)
        if cs >= 0:  # a conditional entry acts once its gate is decided on
            on = on & (tl.load(gate_ptr + entries + e) != 0)
        hits += on.to(tl.int32)
        decides += ((cs == SITE) & (tl.load(cpos_ptr + entries + e) == raw_pos)).to(tl.int32)
    if hits + decides > 0:
        offs = tl.arange(0, BLOCK)
        m = offs < H
        x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        s = x
        if HAS_OTHER:
            s += tl.load(other_ptr + row * stride_o + offs, mask=m, other=0.0).to(tl.float32)
        if hits > 0:
            delta = tl.zeros([BLOCK], dtype=tl.float32)
            for e in tl.static_range(E):
                word = tl.load(posbits_ptr + entries + e * W + pos // 32)
                on = (tl.load(site_ptr + entries + e) == SITE) & \
                    (((word >> (pos % 32)) & 1) == 1)
                if tl.load(csite_ptr + entries + e) >= 0:
                    on = on & (tl.load(gate_ptr + entries + e) != 0)
                if on:
                    vi = tl.load(vec_ptr + entries + e).to(tl.int64)
                    v = tl.load(bank_ptr + vi * stride_b + offs, mask=m, other=0.0).to(tl.float32)
                    u = v * tl.load(inv_ptr + vi)
                    p = tl.sum(s * u, axis=0)
                    lo = tl.load(coef_ptr + entries + e * 4 + 1)
                    hi = tl.load(coef_ptr + entries + e * 4 + 2)
                    g = tl.load(coef_ptr + entries + e * 4 + 3)
                    pc = tl.minimum(tl.maximum(p, lo), hi)
                    d = tl.load(coef_ptr + entries + e * 4) * v + (pc - p) * u + g * (v * s)
                    s += d
                    delta += d
            tl.store(x_ptr + row * stride_x + offs, (x + delta).to(x_ptr.dtype.element_ty),
                     mask=m)
        if decides > 0:  # score the stream as it leaves this site's steering
            for e in tl.static_range(E):
                hit = (tl.load(csite_ptr + entries + e) == SITE) & \
                    (tl.load(cpos_ptr + entries + e) == raw_pos)
                if hit:
                    ci = tl.load(cvec_ptr + entries + e).to(tl.int64)
                    w = tl.load(bank_ptr + ci * stride_b + offs, mask=m, other=0.0).to(tl.float32)
                    mode = tl.load(cmode_ptr + entries + e)
                    score = tl.sum(s * w, axis=0)
                    if (mode & 1) != 0:
                        score = score * tl.load(inv_ptr + ci)
                    score += tl.load(ccoef_ptr + entries + e * 2)
                    if (mode & 2) != 0:
                        score = tl.sigmoid(score)
                    thr = tl.load(ccoef_ptr + entries + e * 2 + 1)
                    gate = tl.where((mode & 4) != 0, score < thr, score > thr)
                    tl.store(gate_ptr + entries + e, gate.to(tl.int32))


def steer_triton(t: SteerTables, tok_slot: torch.Tensor, x: torch.Tensor,
                 other: torch.Tensor | None, positions: torch.Tensor, site: int,
                 col: int = 0) -> None:
    """`col`: where x's columns start in the vectors (steer_reference)."""
    n, h = x.shape
    if n == 0:
        return
    block = triton.next_power_of_2(h)
    _steer_kernel[(n,)](
        x, other if other is not None else x, positions, tok_slot, t.site, t.vec, t.coef,
        t.pos, t.bank[:, col:], t.inv_norm, t.cond_site, t.cond_vec, t.cond_mode, t.cond_coef,
        t.cond_pos, t.gate, h, x.stride(0), other.stride(0) if other is not None else 0,
        t.bank.stride(0), t.site.stride(0), t.pos.shape[2], t.max_len, site,
        HAS_OTHER=other is not None, E=t.max_steers, BLOCK=block,
        num_warps=4 if block <= 2048 else 8)
