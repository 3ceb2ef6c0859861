"""Heads under tensor parallelism without an engine (engine/heads.py): each rank's share
is vLLM's (query heads in blocks, KV heads in blocks or replicated when fewer than the
ranks), the ranks' writes cover every TP=1 column once, and the ops run per rank on their
slice (capture and z steering from a column, patterns and attention mass from a head)
into zeroed rows sum to exactly what one rank holding every head writes (torch reference
and Triton kernels in Triton's interpreter)."""
import math

import pytest
import torch

from graphtap.engine.heads import HeadSplit
from graphtap.ops.capture import capture_reference
from graphtap.ops.mass import mass_reference
from graphtap.ops.pattern import pattern_reference
from graphtap.ops.steer import steer_reference
from graphtap.ops.tables import KeyCache
from graphtap.spec.positions import position_bitmap
from helpers import engine_tables

D = 8


def vllm_kv_head0(rank, tp, kv):
    """vLLM's QKVParallelLinear: kv // tp heads per rank, or one replicated tp // kv times."""
    return rank // (tp // kv) if kv < tp else rank * (kv // tp)


@pytest.mark.parametrize("heads,kv,tp", [(4, 4, 2), (4, 2, 2), (8, 2, 4), (4, 1, 2),
                                         (32, 8, 2)])
def test_each_rank_writes_its_slice_and_the_ranks_cover_every_column_once(heads, kv, tp):
    for kind, total, local in (("attn_q", heads, heads // tp), ("attn_z", heads, heads // tp),
                               ("attn_k", kv, max(1, kv // tp)), ("attn_v", kv, max(1, kv // tp)),
                               ("resid_post", 1, 1)):
        width = D * total if kind != "resid_post" else 16
        written = torch.zeros(width, dtype=torch.int32)
        for rank in range(tp):
            s = HeadSplit(rank, tp, heads, kv, D)
            if kind in ("attn_k", "attn_v"):
                assert s.column(kind) == vllm_kv_head0(rank, tp, kv) * D
            elif kind != "resid_post":
                assert s.column(kind) == rank * (heads // tp) * D == s.head0 * D
            if s.writes(kind):
                n = width if kind == "resid_post" else local * D
                written[s.column(kind):s.column(kind) + n] += 1
        assert written.eq(1).all(), (kind, written)


def split_q(q, rank, tp):
    n = q.shape[1] // tp
    return q[:, rank * n:(rank + 1) * n]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_captures_of_every_rank_sum_to_the_whole_row(backend):
    from graphtap.ops.capture_triton import capture_triton

    op = capture_reference if backend == "torch" else capture_triton
    heads, kv, tp, n = 4, 2, 2, 5
    whole = engine_tables(max_tokens=8, capture_width=heads * D).ops.capture
    whole.dst[2, :n] = torch.tensor([4, 0, 2, whole.rows, 1])  # one token not captured
    x = torch.randn(n, heads, D).to(torch.bfloat16)
    op(whole, x, None, 2)
    total = torch.zeros_like(whole.buf)
    for rank in range(tp):
        t = engine_tables(max_tokens=8, capture_width=heads * D).ops.capture
        t.dst.copy_(whole.dst)
        t.buf.zero_()
        s = HeadSplit(rank, tp, heads, kv, D)
        op(t, split_q(x, rank, tp).contiguous(), None, 2, s.column("attn_q"))
        total += t.buf
    rows = [0, 1, 2, 4]
    assert torch.equal(total[rows], whole.buf[rows])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_z_steering_per_rank_equals_one_rank_steering_every_head(backend):
    from graphtap.ops.steer_triton import steer_triton

    op = steer_reference if backend == "torch" else steer_triton
    heads, tp = 4, 2

    def tables():
        t = engine_tables(max_reqs=2, max_tokens=6, max_steers=2, max_vectors=2,
                          hidden=heads * D, steer_width=heads * D, max_len=16).ops.steer
        mask = torch.zeros(heads * D)
        mask[2 * D:3 * D] = 1.0  # head 2, on rank 1: scaled by 0.5
        add = torch.zeros(heads * D)
        add[1 * D:2 * D] = torch.arange(D, dtype=torch.float32)  # head 1, rank 0
        t.bank[1], t.bank[2] = mask, add
        t.inv_norm[1], t.inv_norm[2] = 1 / mask.norm(), 1 / add.norm()
        t.site[0, :2] = 0
        t.vec[0, 0], t.vec[0, 1] = 1, 2
        t.coef[0, 0] = torch.tensor([0.0, -math.inf, math.inf, -0.5])
        t.coef[0, 1] = torch.tensor([2.0, -math.inf, math.inf, 0.0])
        t.pos[0, :2] = torch.from_numpy(position_bitmap("all", 3, 16, t.pos.shape[2]))
        return t
    tok_slot = torch.tensor([0, 2, 0, 0, 2, 0])
    z = torch.randn(6, heads, D)
    whole = z.clone()
    op(tables(), tok_slot, whole.view(6, -1), None, torch.arange(6), 0)
    parts = []
    for rank in range(tp):
        s = HeadSplit(rank, tp, heads, heads, D)
        local = split_q(z, rank, tp).contiguous()
        op(tables(), tok_slot, local.view(6, -1), None, torch.arange(6), 0, s.column("attn_z"))
        parts.append(local)
    assert torch.equal(torch.cat(parts, dim=1), whole)
    assert not torch.equal(whole, z)


def paged(kv, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(6, 16, kv, D, generator=g)  # [blocks, block_size, kv_heads, D]
    table = torch.tensor([[3, 1, 0, 0], [5, 2, 4, 0]], dtype=torch.int32)
    return keys, table


ROWS = [(1, 0, 0, 0, 0, 1), (1, 3, 3, 0, 30, 0), (1, 4, 1, 1, 40, 1),
        (1, 6, 2, 1, 47, 0), (2, 5, 0, 1, 12, 1), (1, 2, 1, 0, 9, 0)]


def routed(t):
    from graphtap.ops.tables import Label

    t.labels[:, Label.SITE] = -1
    for i, (site, tok, head, brow, pos, slot) in enumerate(ROWS):
        for col, v in ((Label.SITE, site), (Label.TOKEN, tok), (Label.HEAD, head),
                       (Label.BATCH_ROW, brow), (Label.POSITION, pos), (Label.SLOT, slot)):
            t.labels[i, col] = v
    return t


@pytest.mark.parametrize("heads,kv", [(4, 2), (4, 4), (4, 1)], ids=["gqa", "mha", "kv<tp"])
@pytest.mark.parametrize("family", ["pattern", "mass"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_patterns_and_mass_per_rank_sum_to_every_head(heads, kv, family, backend):
    """Each rank computes the rows of its query heads from its q and its KV heads (a
    replicated KV head when KV < tp) and leaves the others alone."""
    from graphtap.ops.mass_triton import mass_triton
    from graphtap.ops.pattern_triton import pattern_triton

    op = {("pattern", "torch"): pattern_reference, ("pattern", "triton"): pattern_triton,
          ("mass", "torch"): mass_reference, ("mass", "triton"): mass_triton}[family, backend]
    tp = 2

    def tables():
        et = engine_tables(max_reqs=2, max_captures=2, num_heads=heads, pattern_rows=8,
                           max_len=64, max_spans=2, mass_rows=8)
        t = et.ops.pattern if family == "pattern" else et.ops.mass
        if family == "mass":
            for slot in (0, 1):
                t.entry_site[slot, 0] = 1
                t.entry_spans[slot, 0] = torch.tensor([[0, 5], [5, 64]], dtype=torch.int32)
        t.buf.zero_()
        return routed(t)
    keys, table = paged(kv)
    q = torch.randn(8, heads, D, generator=torch.Generator().manual_seed(4))
    whole = tables()
    op(whole, q, KeyCache(keys, table, 0.3, heads // kv), 1)
    total = torch.zeros_like(whole.buf)
    for rank in range(tp):
        s = HeadSplit(rank, tp, heads, kv, D)
        kv_local = max(1, kv // tp)
        local_keys = keys[:, :, s.kv_head0:s.kv_head0 + kv_local]
        t = tables()
        op(t, split_q(q, rank, tp), KeyCache(local_keys, table, 0.3,
                                             (heads // tp) // kv_local, s.head0), 1)
        total += t.buf
    assert whole.buf.abs().sum() > 0
    torch.testing.assert_close(total, whole.buf, rtol=0, atol=0)
