"""Triton kernel for attention mass: one program per buffer row (fixed grid of mass_rows
programs, fixed launch config), the pattern kernel's two passes over the request's block
table (online max and sum, then the normalised weights), the second summing the weights
that fall in each of the entry's S spans instead of storing them."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphtap.ops.pattern_triton import BLOCK_N, _block_scores, _softmax_stats
from graphtap.ops.tables import LABELS, KeyCache, Label, MassTables


@triton.jit
def _mass_kernel(labels_ptr, q_ptr, k_ptr, bt_ptr, buf_ptr, site_ptr, spans_ptr, SITE, scale,
                 sq_t, sq_h, sq_d, sk_b, sk_n, sk_h, sk_d, s_bt, s_buf, s_slot, D, BS, GROUP,
                 HEAD0, NH, L: tl.constexpr, C_SITE: tl.constexpr, C_TOKEN: tl.constexpr,
                 C_HEAD: tl.constexpr, C_BROW: tl.constexpr, C_POS: tl.constexpr,
                 C_SLOT: tl.constexpr, C: tl.constexpr, S: tl.constexpr,
                 BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    label = labels_ptr + row * L
    site = tl.load(label + C_SITE)
    head = tl.load(label + C_HEAD) - HEAD0  # this rank's heads: 0..NH-1
    if (site == SITE) & (head >= 0) & (head < NH):
        tok = tl.load(label + C_TOKEN)
        brow = tl.load(label + C_BROW)
        slot = tl.load(label + C_SLOT)
        n_keys = tl.load(label + C_POS) + 1
        entry = 0
        for e in tl.static_range(C):  # the one entry of this slot at this site
            entry = tl.where(tl.load(site_ptr + slot * s_slot + e) == SITE, e, entry)
        spans = spans_ptr + slot * s_slot + entry * S * 2
        s_idx = tl.arange(0, BLOCK_S)
        sm = s_idx < S
        lo = tl.load(spans + s_idx * 2, mask=sm, other=0)
        hi = tl.load(spans + s_idx * 2 + 1, mask=sm, other=0)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        qv = tl.load(q_ptr + tok * sq_t + head * sq_h + d * sq_d, mask=dm, other=0.0).to(tl.float32)
        k_head = k_ptr + (head // GROUP) * sk_h
        m_i, l_i = _softmax_stats(k_head, qv, bt_ptr, brow, s_bt, n_keys, sk_b, sk_n, sk_d, d,
                                  dm, scale, BS, BLOCK_N)
        acc = tl.zeros([BLOCK_S], tl.float32)
        for start in range(0, n_keys, BLOCK_N):  # the normalised weights, summed per span
            j, jm, s = _block_scores(k_head, qv, bt_ptr, brow, s_bt, start, n_keys, sk_b, sk_n,
                                     sk_d, d, dm, scale, BS, BLOCK_N)
            p = tl.where(jm, tl.exp(s - m_i) / l_i, 0.0)
            inside = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])  # [S, BLOCK_N]
            acc += tl.sum(tl.where(inside, p[None, :], 0.0), 1)
        tl.store(buf_ptr + row * s_buf + s_idx, acc, mask=sm)


def mass_triton(t: MassTables, q: torch.Tensor, kc: KeyCache, site: int) -> None:
    keys, bt = kc.keys, kc.block_table
    dim = q.shape[-1]
    _mass_kernel[(t.rows,)](
        t.labels, q, keys, bt, t.buf, t.entry_site, t.entry_spans, site, kc.scale,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        keys.stride(3), bt.stride(0), t.buf.stride(0), t.entry_site.stride(0), dim,
        keys.shape[1], kc.group, kc.head0, q.shape[1], L=LABELS, C_SITE=int(Label.SITE), C_TOKEN=int(Label.TOKEN),
        C_HEAD=int(Label.HEAD), C_BROW=int(Label.BATCH_ROW), C_POS=int(Label.POSITION),
        C_SLOT=int(Label.SLOT), C=t.entry_site.shape[1], S=t.entry_spans.shape[2],
        BLOCK_S=triton.next_power_of_2(t.entry_spans.shape[2]), BLOCK_D=triton.next_power_of_2(dim), BLOCK_N=BLOCK_N, num_warps=4)
