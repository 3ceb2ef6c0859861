"""Per-step routing on the GPU (route.py's references, in a few launches).

The torch versions are ~8 (token slots) and ~35 (row units) small ops; on the H200's
host each launch cost tens of microseconds, ~3 ms per capturing step on the engine's
critical path, which small models pay in full. Here: one kernel finds each token row's
request by binary search over the batch's query start locations; for a row family, one
kernel counts the wanted units of each (site, block of tokens) and of each request, one
program decides which requests fit whole, a third drops the units of those that do
not, and a last turns the counts before a block into its first buffer row and writes
rows and labels. Launch
shapes and constexprs are fixed per engine (token counts only set the grid or are not
specialised; request counts are read from the device), so nothing is compiled after
the warm-up at start, and one token count's launches can be captured once as a CUDA
graph that serves every batch of that size (engine/route_graphs.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphtap.ops.tables import LABELS, ROUTE_MIN_BLOCK, Label, RowTables

BLOCK = 1024
FIT_BLOCK = 1024  # request slots per pass of the fit's sum


@triton.jit(do_not_specialize=["n"])
def _tokens_kernel(qsl_ptr, idx_ptr, nreq_ptr, slot_ptr, row_ptr, n, SENTINEL,
                   STEPS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    # the request count from the device, so that a captured launch serves any batch
    num_reqs = tl.load(nreq_ptr)
    # batch row = how many of qsl[1..num_reqs] are <= the token row (searchsorted, right)
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.zeros([BLOCK], dtype=tl.int32) + num_reqs
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(qsl_ptr + 1 + mid, mask=m & active, other=0)
        lo = tl.where(active & (v <= offs), mid + 1, lo)
        hi = tl.where(active & (v > offs), mid, hi)
    row = tl.maximum(tl.minimum(lo, num_reqs - 1), 0)
    slot = tl.load(idx_ptr + row, mask=m, other=0).to(tl.int64)
    slot = tl.where(offs < tl.load(qsl_ptr + num_reqs), slot, SENTINEL)
    tl.store(slot_ptr + offs, slot, mask=m)
    tl.store(row_ptr + offs, row.to(tl.int64), mask=m)


def route_tokens_triton(tok_slot: torch.Tensor, tok_row: torch.Tensor, sentinel: int,
                        qsl: torch.Tensor, idx_mapping: torch.Tensor, n: int,
                        num_reqs: torch.Tensor, block: int = BLOCK) -> None:
    """num_reqs: a one-element int32 device tensor (engine/router.py stages it), not a
    launch argument, so that the launch can be captured once per token count."""
    if n == 0:
        return
    steps = (sentinel + 1).bit_length() + 1  # enough halvings for max_num_seqs, fixed
    _tokens_kernel[(triton.cdiv(n, block),)](qsl, idx_mapping, num_reqs, tok_slot, tok_row,
                                              n, sentinel, STEPS=steps, BLOCK=block)


@triton.jit
def _entry_hit(site_ptr, bits_ptr, entries, c, s, pos, W, m):
    """Whether entry c of each token's slot is site s and wants the token's position."""
    hit = m & (tl.load(site_ptr + entries + c, mask=m, other=-1) == s)
    word = tl.load(bits_ptr + entries + c * W + pos // 32, mask=hit, other=0)
    return hit & (((word >> (pos % 32)) & 1) == 1)


@triton.jit(do_not_specialize=["n", "nb"])
def _flags_kernel(slot_ptr, pos_ptr, site_ptr, bits_ptr, heads_ptr, flags_ptr, counts_ptr,
                  slot_count_ptr, n, nb, N, W, stride_slot, max_len, C: tl.constexpr,
                  HEADS: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    b = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    slot = tl.load(slot_ptr + offs, mask=m, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + offs, mask=m, other=0).to(tl.int32)
    pos = tl.minimum(tl.maximum(pos, 0), max_len - 1)
    entries = slot * stride_slot
    units = tl.zeros([BLOCK], dtype=tl.int32)
    for c in tl.static_range(C):
        on = _entry_hit(site_ptr, bits_ptr, entries, c, s, pos, W, m)
        if HEADS == 0:  # one whole row per token
            units = tl.where(on, 1, units)
        else:  # one row per chosen head
            k = tl.zeros([BLOCK], dtype=tl.int32)
            for h in tl.static_range(HEADS):
                k += (tl.load(heads_ptr + entries + c * HEADS + h, mask=on, other=0) != 0
                      ).to(tl.int32)
            units = tl.where(on, k, units)
    tl.store(flags_ptr + s * N + offs, units, mask=m)
    tl.store(counts_ptr + s * nb + b, tl.sum(units, axis=0))
    # Per request slot, so that the rows go to the requests that fit whole.
    tl.atomic_add(slot_count_ptr + slot, units.to(tl.int64), mask=m & (units > 0))


@triton.jit(do_not_specialize=["slots"])
def _fit_kernel(wanted_ptr, fits_ptr, slots, K, BLOCK: tl.constexpr):
    """One program: slots taken whole, in order, while the buffer has room (route.py's
    _fit_requests). When every slot fits (the usual step), blocks of slots at a time;
    only a step that overflows scans them one by one (a scalar load per slot: vLLM
    serves up to 1024 sequences on an H200 by default)."""
    total = tl.zeros((), dtype=tl.int64)
    for s0 in range(0, slots, BLOCK):
        offs = s0 + tl.arange(0, BLOCK)
        total += tl.sum(tl.load(wanted_ptr + offs, mask=offs < slots, other=0), axis=0)
    if total <= K:
        for s0 in range(0, slots, BLOCK):
            offs = s0 + tl.arange(0, BLOCK)
            tl.store(fits_ptr + offs, tl.full([BLOCK], 1, tl.int32), mask=offs < slots)
    else:
        used = tl.zeros((), dtype=tl.int64)
        for s in range(0, slots):
            c = tl.load(wanted_ptr + s)
            take = used + c <= K
            tl.store(fits_ptr + s, take.to(tl.int32))
            used += tl.where(take, c, 0)


@triton.jit(do_not_specialize=["n", "nb"])
def _refit_kernel(slot_ptr, fits_ptr, flags_ptr, counts_ptr, n, nb, N, BLOCK: tl.constexpr):
    """The units of slots that do not fit dropped from the flags and the block counts."""
    s = tl.program_id(0)
    b = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    slot = tl.load(slot_ptr + offs, mask=m, other=0).to(tl.int64)
    units = tl.load(flags_ptr + s * N + offs, mask=m, other=0)
    units = tl.where(tl.load(fits_ptr + slot, mask=m, other=0) != 0, units, 0)
    tl.store(flags_ptr + s * N + offs, units, mask=m)
    tl.store(counts_ptr + s * nb + b, tl.sum(units, axis=0))


@triton.jit
def _store_label(labels_ptr, row, ok, slot, s, pos, head, tok, brow, L: tl.constexpr,
                 C_SLOT: tl.constexpr, C_SITE: tl.constexpr, C_POS: tl.constexpr,
                 C_HEAD: tl.constexpr, C_TOKEN: tl.constexpr, C_BROW: tl.constexpr):
    label = labels_ptr + row * L
    tl.store(label + C_SLOT, slot, mask=ok)
    tl.store(label + C_SITE, s + tl.zeros_like(slot), mask=ok)
    tl.store(label + C_POS, pos, mask=ok)
    tl.store(label + C_HEAD, head, mask=ok)
    tl.store(label + C_TOKEN, tok, mask=ok)
    tl.store(label + C_BROW, brow, mask=ok)


@triton.jit(do_not_specialize=["n", "nb"])
def _rows_kernel(flags_ptr, counts_ptr, slot_ptr, brow_ptr, pos_ptr, site_ptr, bits_ptr,
                 heads_ptr, dst_ptr, labels_ptr, count_ptr, n, nb, N, K, W, stride_slot,
                 max_len, S, C: tl.constexpr, HEADS: tl.constexpr, WRITE_DST: tl.constexpr,
                 L: tl.constexpr, C_SLOT: tl.constexpr, C_SITE: tl.constexpr,
                 C_POS: tl.constexpr, C_HEAD: tl.constexpr, C_TOKEN: tl.constexpr,
                 C_BROW: tl.constexpr, BLOCK: tl.constexpr, CBLOCK: tl.constexpr):
    s = tl.program_id(0)
    b = tl.program_id(1)
    me = s * nb + b  # site-major, as the rows are numbered
    ci = tl.arange(0, CBLOCK)
    base = tl.sum(tl.load(counts_ptr + ci, mask=ci < me, other=0), axis=0).to(tl.int64)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    units = tl.load(flags_ptr + s * N + offs, mask=m, other=0).to(tl.int64)
    first = base + tl.cumsum(units, axis=0) - units  # each token's first row
    wanted = units > 0
    if WRITE_DST:
        tl.store(dst_ptr + s * N + offs, tl.where(wanted & (first < K), first, K), mask=m)
    slot = tl.load(slot_ptr + offs, mask=wanted, other=0).to(tl.int64)
    brow = tl.load(brow_ptr + offs, mask=wanted, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + offs, mask=wanted, other=0).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_len - 1)
    tok = offs.to(tl.int64)
    if HEADS == 0:
        ok = wanted & (first < K)
        _store_label(labels_ptr, tl.where(ok, first, K), ok, slot, s, pos, tl.zeros_like(pos),
                     tok, brow, L, C_SLOT, C_SITE, C_POS, C_HEAD, C_TOKEN, C_BROW)
    else:
        entries = slot * stride_slot
        entry = tl.zeros([BLOCK], dtype=tl.int64)  # the entry of the site (at most one)
        for c in tl.static_range(C):
            on = _entry_hit(site_ptr, bits_ptr, entries, c, s, pos.to(tl.int32), W, wanted)
            entry = tl.where(on, c, entry)
        rank = tl.zeros([BLOCK], dtype=tl.int64)
        for h in tl.static_range(HEADS):
            on = wanted & (tl.load(heads_ptr + entries + entry * HEADS + h, mask=wanted,
                                   other=0) != 0)
            row = first + rank
            ok = on & (row < K)
            _store_label(labels_ptr, tl.where(ok, row, K), ok, slot, s, pos,
                         h + tl.zeros_like(pos), tok, brow, L, C_SLOT, C_SITE, C_POS, C_HEAD,
                         C_TOKEN, C_BROW)
            rank += on.to(tl.int64)
    # The last block of the last site knows every count before it: the rows written.
    total = base + tl.sum(units, axis=0)
    tl.store(count_ptr, total, mask=me == S * nb - 1)


def route_rows_triton(t: RowTables, slot: torch.Tensor, brow: torch.Tensor,
                      positions: torch.Tensor, max_len: int, block: int = BLOCK) -> None:
    n = slot.shape[0]
    t.labels[:, Label.SITE].fill_(-1)
    t.count.zero_()
    if n == 0:
        return
    num_sites, N = t.num_sites, t.flags.shape[1]
    nb = triton.cdiv(n, block)
    assert block >= ROUTE_MIN_BLOCK and num_sites * nb <= t.block_counts.numel()
    cblock = triton.next_power_of_2(num_sites * triton.cdiv(N, block))  # fixed per engine
    heads = 0 if t.entry_heads is None else t.entry_heads.shape[2]
    heads_table = t.entry_site if t.entry_heads is None else t.entry_heads
    grid = (num_sites, nb)
    c, w, stride = t.entry_site.shape[1], t.entry_pos.shape[2], t.entry_site.stride(0)
    _flags_kernel[grid](slot, positions, t.entry_site, t.entry_pos, heads_table, t.flags,
                        t.block_counts, t.count[1:], n, nb, N, w, stride, max_len, C=c,
                        HEADS=heads, BLOCK=block)
    _fit_kernel[(1,)](t.count[1:], t.fits, t.fits.shape[0], t.rows, BLOCK=FIT_BLOCK)
    _refit_kernel[grid](slot, t.fits, t.flags, t.block_counts, n, nb, N, BLOCK=block)
    cols = dict(L=LABELS, C_SLOT=int(Label.SLOT), C_SITE=int(Label.SITE),
                C_POS=int(Label.POSITION), C_HEAD=int(Label.HEAD), C_TOKEN=int(Label.TOKEN),
                C_BROW=int(Label.BATCH_ROW))
    _rows_kernel[grid](t.flags, t.block_counts, slot, brow, positions, t.entry_site,
                       t.entry_pos, heads_table, t.dst if t.dst is not None else t.flags,
                       t.labels, t.count, n, nb, N, t.rows, w, stride, max_len, num_sites,
                       C=c, HEADS=heads, WRITE_DST=t.dst is not None, **cols, BLOCK=block,
                       CBLOCK=cblock)
