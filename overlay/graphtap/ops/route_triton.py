"""Per-step routing on the GPU (route.py's references, in three launches).

The torch versions are ~8 (token slots) and ~35 (capture rows) small ops; on the H200's
host each launch cost tens of microseconds, ~3 ms per capturing step on the engine's
critical path (prepare_step, profiled), which small models pay in full. Here: one kernel
finds each token row's request by binary search over the batch's query start locations;
for captures, one kernel marks the wanted (site, token) pairs of each block of tokens and
counts them, a second turns the counts before a block into its first buffer row and
writes rows and labels. Launch shapes and constexprs are fixed per engine (token and
request counts only set the grid or are not specialised), so nothing is compiled after
the warm-up at start.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphtap.tables import ROUTE_MIN_BLOCK, CaptureTables, SteerTables

BLOCK = 1024


@triton.jit(do_not_specialize=["n", "num_reqs"])
def _tokens_kernel(qsl_ptr, idx_ptr, slot_ptr, row_ptr, n, num_reqs, SENTINEL,
                   STEPS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    # batch row = how many of qsl[1..num_reqs] are <= the token row (searchsorted, right)
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.zeros([BLOCK], dtype=tl.int32) + num_reqs
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(qsl_ptr + 1 + mid, mask=m & active, other=0)
        lo = tl.where(active & (v <= offs), mid + 1, lo)
        hi = tl.where(active & (v > offs), mid, hi)
    row = tl.minimum(lo, num_reqs - 1)
    slot = tl.load(idx_ptr + row, mask=m, other=0).to(tl.int64)
    slot = tl.where(offs < tl.load(qsl_ptr + num_reqs), slot, SENTINEL)
    tl.store(slot_ptr + offs, slot, mask=m)
    tl.store(row_ptr + offs, row.to(tl.int64), mask=m)


def route_tokens_triton(t: SteerTables, qsl: torch.Tensor, idx_mapping: torch.Tensor, n: int,
                        num_reqs: int, block: int = BLOCK) -> None:
    if n == 0 or num_reqs == 0:
        return
    steps = (t.sentinel + 1).bit_length() + 1  # enough halvings for max_num_seqs, fixed
    _tokens_kernel[(triton.cdiv(n, block),)](qsl, idx_mapping, t.tok_slot, t.tok_row, n,
                                              num_reqs, t.sentinel, STEPS=steps, BLOCK=block)


@triton.jit(do_not_specialize=["n", "nb"])
def _flags_kernel(slot_ptr, pos_ptr, site_ptr, bits_ptr, flags_ptr, counts_ptr, n, nb, N, W,
                  max_len, C: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    b = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    slot = tl.load(slot_ptr + offs, mask=m, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + offs, mask=m, other=0).to(tl.int32)
    pos = tl.minimum(tl.maximum(pos, 0), max_len - 1)
    on = tl.zeros([BLOCK], dtype=tl.int32)
    for c in tl.static_range(C):
        entry = slot * C + c
        hit = m & (tl.load(site_ptr + entry, mask=m, other=-1) == s)
        word = tl.load(bits_ptr + entry * W + pos // 32, mask=hit, other=0)
        on = tl.where(hit & (((word >> (pos % 32)) & 1) == 1), 1, on)
    tl.store(flags_ptr + s * N + offs, on.to(tl.int8), mask=m)
    tl.store(counts_ptr + s * nb + b, tl.sum(on, axis=0))


@triton.jit(do_not_specialize=["n", "nb"])
def _rows_kernel(flags_ptr, counts_ptr, slot_ptr, pos_ptr, dst_ptr, meta_ptr, count_ptr, n,
                 nb, N, K, max_len, S, BLOCK: tl.constexpr, CBLOCK: tl.constexpr):
    s = tl.program_id(0)
    b = tl.program_id(1)
    me = s * nb + b  # site-major, as the rows are numbered
    ci = tl.arange(0, CBLOCK)
    base = tl.sum(tl.load(counts_ptr + ci, mask=ci < me, other=0), axis=0).to(tl.int64)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    on = tl.load(flags_ptr + s * N + offs, mask=m, other=0).to(tl.int32)
    idx = base + tl.cumsum(on, axis=0).to(tl.int64) - 1
    ok = (on != 0) & (idx < K)
    dst = tl.where(ok, idx, K)
    tl.store(dst_ptr + s * N + offs, dst, mask=m)
    slot = tl.load(slot_ptr + offs, mask=ok, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + offs, mask=ok, other=0).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_len - 1)
    tl.store(meta_ptr + dst * 3, slot, mask=ok)
    tl.store(meta_ptr + dst * 3 + 1, (s + tl.zeros([BLOCK], dtype=tl.int64)), mask=ok)
    tl.store(meta_ptr + dst * 3 + 2, pos, mask=ok)
    # The last block of the last site knows every count before it: the step's total
    # (past K too: the courier reports an overflow from it).
    total = base + tl.sum(on, axis=0).to(tl.int64)
    tl.store(count_ptr, total, mask=me == S * nb - 1)


def route_triton(t: CaptureTables, slot: torch.Tensor, positions: torch.Tensor, max_len: int,
                 block: int = BLOCK) -> None:
    n = slot.shape[0]
    if n == 0:
        return
    num_sites, N = t.cap_dst.shape
    nb = triton.cdiv(n, block)
    assert block >= ROUTE_MIN_BLOCK and num_sites * nb <= t.route_counts.numel()
    cblock = triton.next_power_of_2(num_sites * triton.cdiv(N, block))  # fixed per engine
    t.meta[:, 0].fill_(-1)
    grid = (num_sites, nb)
    _flags_kernel[grid](slot, positions, t.cap_site, t.cap_pos, t.route_flags, t.route_counts,
                        n, nb, N, t.cap_pos.shape[2], max_len, C=t.cap_site.shape[1],
                        BLOCK=block)
    _rows_kernel[grid](t.route_flags, t.route_counts, slot, positions, t.cap_dst, t.meta,
                       t.count, n, nb, N, t.rows, max_len, num_sites, BLOCK=block,
                       CBLOCK=cblock)
