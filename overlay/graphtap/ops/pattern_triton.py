"""Triton kernel for attention patterns: one program per buffer row (fixed grid of
pattern_rows programs, fixed launch config, no autotune). A program whose row belongs to
another site or none returns after one load; an active one walks its request's block
table twice (online max and sum, then the normalised probabilities)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphtap.ops.tables import LABELS, KeyCache, Label, RowTables

BLOCK_N = 64


@triton.jit
def _block_scores(k_head, qv, bt_ptr, brow, s_bt, start, n_keys, sk_b, sk_n, sk_d, d, dm, scale,
                  BS, BLOCK_N: tl.constexpr):
    """Scaled scores of keys start..start+BLOCK_N (-inf past n_keys) and their offsets."""
    j = start + tl.arange(0, BLOCK_N)
    jm = j < n_keys
    blk = tl.load(bt_ptr + brow * s_bt + j // BS, mask=jm, other=0).to(tl.int64)
    kp = k_head + blk[:, None] * sk_b + (j % BS)[:, None] * sk_n + d[None, :] * sk_d
    k = tl.load(kp, mask=jm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    return j, jm, tl.where(jm, tl.sum(k * qv[None, :], 1) * scale, float("-inf"))


@triton.jit
def _softmax_stats(k_head, qv, bt_ptr, brow, s_bt, n_keys, sk_b, sk_n, sk_d, d, dm, scale, BS,
                   BLOCK_N: tl.constexpr):
    """The online max and sum of exp over a query's keys (the first of two passes)."""
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    for start in range(0, n_keys, BLOCK_N):
        j, jm, s = _block_scores(k_head, qv, bt_ptr, brow, s_bt, start, n_keys, sk_b, sk_n,
                                 sk_d, d, dm, scale, BS, BLOCK_N)
        m_new = tl.maximum(m_i, tl.max(s, 0))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new), 0)
        m_i = m_new
    return m_i, l_i


@triton.jit
def _pattern_kernel(labels_ptr, q_ptr, k_ptr, bt_ptr, buf_ptr, SITE, scale,
                    sq_t, sq_h, sq_d, sk_b, sk_n, sk_h, sk_d, s_bt, s_buf, D, BS, GROUP,
                    HEAD0, NH, L: tl.constexpr, C_SITE: tl.constexpr, C_TOKEN: tl.constexpr,
                    C_HEAD: tl.constexpr, C_BROW: tl.constexpr, C_POS: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    label = labels_ptr + row * L
    site = tl.load(label + C_SITE)
    head = tl.load(label + C_HEAD) - HEAD0  # this rank's heads: 0..NH-1
    if (site == SITE) & (head >= 0) & (head < NH):
        tok = tl.load(label + C_TOKEN)
        brow = tl.load(label + C_BROW)
        n_keys = tl.load(label + C_POS) + 1
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        qv = tl.load(q_ptr + tok * sq_t + head * sq_h + d * sq_d, mask=dm, other=0.0).to(tl.float32)
        k_head = k_ptr + (head // GROUP) * sk_h
        m_i, l_i = _softmax_stats(k_head, qv, bt_ptr, brow, s_bt, n_keys, sk_b, sk_n, sk_d, d,
                                  dm, scale, BS, BLOCK_N)
        for start in range(0, n_keys, BLOCK_N):  # normalised probabilities
            j, jm, s = _block_scores(k_head, qv, bt_ptr, brow, s_bt, start, n_keys, sk_b, sk_n,
                                     sk_d, d, dm, scale, BS, BLOCK_N)
            tl.store(buf_ptr + row * s_buf + j, tl.exp(s - m_i) / l_i, mask=jm)


def pattern_triton(t: RowTables, q: torch.Tensor, kc: KeyCache, site: int) -> None:
    keys, bt = kc.keys, kc.block_table
    dim = q.shape[-1]
    _pattern_kernel[(t.rows,)](
        t.labels, q, keys, bt, t.buf, site, kc.scale,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        keys.stride(3), bt.stride(0), t.buf.stride(0), dim, keys.shape[1], kc.group,
        kc.head0, q.shape[1], L=LABELS, C_SITE=int(Label.SITE), C_TOKEN=int(Label.TOKEN), C_HEAD=int(Label.HEAD),
        C_BROW=int(Label.BATCH_ROW), C_POS=int(Label.POSITION),
        BLOCK_D=triton.next_power_of_2(dim), BLOCK_N=BLOCK_N, num_warps=4)
