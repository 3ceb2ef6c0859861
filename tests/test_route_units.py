"""Per-step routing: the Triton kernels (Triton's interpreter here) against the torch
references, which the CPU engine tests check end to end against HF. One row router
serves captures (one whole row per wanted token) and attention patterns (one row per
wanted token and chosen head)."""
import copy

import pytest
import torch

from graphtap.ops.tables import Label
from helpers import engine_tables

SLOTS, TOKENS, HEADS = 6, 96, 4


def tables(seed: int, sites: int, rows: int, heads: bool, max_len: int = 100):
    """A row family's tables with random entries; slot SLOTS is the sentinel."""
    g = torch.Generator().manual_seed(seed)
    et = engine_tables(max_reqs=SLOTS, max_tokens=TOKENS, max_captures=3, num_sites=sites,
                       capture_rows=rows, pattern_rows=rows, capture_width=4,
                       num_heads=HEADS, max_len=max_len)
    t = et.ops.pattern if heads else et.ops.capture
    for slot in range(SLOTS):
        chosen = torch.randperm(sites, generator=g)[:int(torch.randint(0, 4, (1,), generator=g))]
        t.entry_site[slot, :len(chosen)] = chosen.to(torch.int32)
        t.entry_pos[slot] = torch.randint(-2**31, 2**31 - 1, t.entry_pos[slot].shape,
                                          generator=g, dtype=torch.int64).to(torch.int32)
        if heads:
            t.entry_heads[slot] = torch.randint(0, 2, t.entry_heads[slot].shape, generator=g,
                                                dtype=torch.int32)
    return t


@pytest.mark.parametrize("heads", [False, True], ids=["captures", "patterns"])
@pytest.mark.parametrize("n,rows", [(1, 500), (37, 500), (96, 500), (96, 20), (50, 0)],
                         ids=["one-token", "blocks", "full", "overflow", "no-room"])
def test_triton_routing_matches_the_reference(n, rows, heads):
    from graphtap.ops.route import route_rows_reference
    from graphtap.ops.route_triton import route_rows_triton

    for seed in range(3):
        ref = tables(seed, sites=5, rows=rows, heads=heads)
        tri = copy.deepcopy(ref)
        g = torch.Generator().manual_seed(100 + seed)
        slot = torch.randint(0, SLOTS + 1, (n,), generator=g)  # SLOTS = sentinel (padding)
        brow = torch.randint(0, 8, (n,), generator=g)
        positions = torch.randint(-3, 130, (n,), generator=g)  # clamped to [0, 100)
        route_rows_reference(ref, slot, brow, positions, 100)
        route_rows_triton(tri, slot, brow, positions.to(torch.int32), 100, block=16)
        if not heads:
            assert torch.equal(tri.dst[:, :n], ref.dst[:, :n]), seed
        assert torch.equal(tri.count, ref.count), seed  # in all, and per request slot
        assert torch.equal(tri.fits, ref.fits) and ref.count[1 + SLOTS] == 0
        # whole requests, while they fit: rows written = what the fitting slots wanted
        assert ref.count[0] == (ref.count[1:] * ref.fits).sum() <= rows
        used = min(int(ref.count[0]), rows)
        assert torch.equal(tri.labels[:used], ref.labels[:used]), seed
        assert (tri.labels[used:, Label.SITE] == -1).all()
        assert (ref.labels[used:, Label.SITE] == -1).all()
    assert ref.count[1:].sum() > 0  # the tables do route something
    assert rows == 0 or ref.count[0] > 0


@pytest.mark.parametrize("heads", [False, True], ids=["captures", "patterns"])
def test_sync_free_reference_labels_the_same_rows(heads):
    """The GPU's torch routing (GRAPHTAP_TORCH_ROUTING=1) labels every unit without a host
    sync; the CPU's labels only the wanted ones: the same rows either way."""
    from graphtap.ops.route import route_rows_reference

    for n, rows in ((37, 500), (96, 20)):
        compact = tables(1, sites=5, rows=rows, heads=heads)
        dense = copy.deepcopy(compact)
        g = torch.Generator().manual_seed(7)
        slot, brow = torch.randint(0, SLOTS + 1, (n,), generator=g), torch.arange(n) % 5
        positions = torch.randint(0, 100, (n,), generator=g)
        route_rows_reference(compact, slot, brow, positions, 100, sync_free=False)
        route_rows_reference(dense, slot, brow, positions, 100, sync_free=True)
        used = min(int(compact.count[0]), rows)
        assert torch.equal(compact.count, dense.count) and torch.equal(compact.labels[:used],
                                                            dense.labels[:used])
        assert torch.equal(compact.labels[:, Label.SITE], dense.labels[:, Label.SITE])
        if not heads:
            assert torch.equal(compact.dst, dense.dst)


def test_pattern_units_are_site_major_then_token_then_head():
    from graphtap.ops.route import route_rows_reference

    t = tables(0, sites=2, rows=50, heads=True)
    t.entry_site.fill_(-1)
    t.entry_site[0, 0], t.entry_site[1, 0], t.entry_site[1, 1] = 1, 1, 0
    t.entry_pos.fill_(-1)  # every position
    t.entry_heads.zero_()
    t.entry_heads[0, 0, [1, 3]] = 1
    t.entry_heads[1, 0, 2] = 1
    t.entry_heads[1, 1, [0, 1]] = 1
    slot = torch.tensor([0, 0, 1, SLOTS])  # a: two tokens, b: one, then padding
    route_rows_reference(t, slot, torch.tensor([0, 0, 1, 0]), torch.tensor([5, 6, 2, 0]), 100)
    cols = [Label.SITE, Label.TOKEN, Label.HEAD, Label.SLOT, Label.POSITION, Label.BATCH_ROW]
    got = t.labels[: int(t.count[0])][:, cols].tolist()
    assert got == [[0, 2, 0, 1, 2, 1], [0, 2, 1, 1, 2, 1],  # site 0: b's heads 0, 1
                   [1, 0, 1, 0, 5, 0], [1, 0, 3, 0, 5, 0],  # site 1: a's token 0
                   [1, 1, 1, 0, 6, 0], [1, 1, 3, 0, 6, 0],  # a's token 1
                   [1, 2, 2, 1, 2, 1]]                       # b's head 2


def test_triton_routing_with_nothing_wanted_routes_every_row_to_the_trash():
    from graphtap.ops.route_triton import route_rows_triton

    t = tables(0, sites=4, rows=50, heads=False)
    t.dst.fill_(7)
    route_rows_triton(t, torch.full((40,), SLOTS), torch.zeros(40, dtype=torch.long),
                      torch.arange(40), 100, block=16)  # all sentinel
    assert (t.dst[:, :40] == 50).all() and not t.count.any()


@pytest.mark.parametrize("n", [1, 17, 64, 90], ids=["one", "blocks", "exact", "padding"])
def test_triton_token_routing_matches_the_reference(n):
    """Each token row's slot and batch row (searchsorted over the query start locations),
    padding rows past the last request's tokens to the sentinel."""
    from graphtap.ops.route import route_tokens_reference
    from graphtap.ops.route_triton import route_tokens_triton

    sentinel = 8
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        ref = (torch.full((96,), sentinel), torch.zeros(96, dtype=torch.long))
        tri = copy.deepcopy(ref)
        num_reqs = int(torch.randint(1, 9, (1,), generator=g))
        used = n if n != 90 else 70  # "padding": the last 20 rows belong to no request
        cuts = torch.sort(torch.randperm(used - 1, generator=g)[:num_reqs - 1] + 1).values \
            if used > 1 and num_reqs > 1 else torch.tensor([], dtype=torch.int64)
        num_reqs = len(cuts) + 1
        qsl = torch.cat([torch.tensor([0]), cuts, torch.tensor([used])]).to(torch.int32)
        qsl = torch.cat([qsl, torch.full((3,), used, dtype=torch.int32)])  # stale tail
        idx = torch.randperm(8, generator=g)[:num_reqs]
        route_tokens_reference(*ref, sentinel, qsl, idx, n, num_reqs)
        route_tokens_triton(*tri, sentinel, qsl, idx, n,
                            torch.tensor([num_reqs], dtype=torch.int32), block=16)
        assert torch.equal(tri[0], ref[0]), (seed, qsl, idx)
        assert torch.equal(tri[1], ref[1]), seed
        assert (ref[0][used:n] == sentinel).all()


def test_backend_is_chosen_once_at_start(monkeypatch):
    """The torch references on CPU; Triton kernels on a GPU, with the routing as torch ops
    when GRAPHTAP_TORCH_ROUTING=1 (read when the backend is chosen, never per step)."""
    from graphtap.ops import backend
    from graphtap.ops.route import route_rows_reference

    assert backend.select_backend(torch.device("cpu")) is backend.TORCH
    monkeypatch.setenv("GRAPHTAP_TORCH_ROUTING", "1")
    gpu = backend.select_backend(torch.device("cuda"))
    assert gpu.name == "triton+torch-routing" and gpu.route_rows is route_rows_reference
    monkeypatch.delenv("GRAPHTAP_TORCH_ROUTING")
    assert backend.select_backend(torch.device("cuda")).name == "triton"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_overflow_fails_only_the_requests_that_do_not_fit(backend):
    """Issue 16 item 5: a big request first in the batch must not take a small one's rows
    with it. Requests get rows whole, in slot order, while they fit."""
    from graphtap.courier import CaptureStep, StepRows
    from graphtap.courier.pack import unpack
    from graphtap.courier.chunks import OVERFLOW, Overflow, OverflowKind
    from graphtap.ops.route import route_rows_reference
    from graphtap.ops.route_triton import route_rows_triton

    t = tables(0, sites=2, rows=20, heads=False)
    t.entry_site.fill_(-1)
    t.entry_pos.fill_(-1)  # every position
    t.entry_site[0, :2] = torch.tensor([0, 1])  # big: 2 sites x 15 tokens = 30 > 20
    t.entry_site[2, 0] = 1  # small: 1 site x 2 tokens
    t.entry_site[3, 0] = 0  # another small one, after the big one too
    slot = torch.tensor([0] * 15 + [2, 2] + [3] + [SLOTS] * 4)
    brow = torch.tensor([0] * 15 + [1, 1] + [2] + [0] * 4)
    positions = torch.cat([torch.arange(15), torch.arange(2), torch.arange(1), torch.zeros(4)])
    route = route_rows_reference if backend == "torch" else \
        lambda *a: route_rows_triton(*a, block=16)
    route(t, slot, brow, positions.long() if backend == "torch" else positions.int(), 100)
    assert t.fits[[0, 2, 3]].tolist() == [0, 1, 1] and int(t.count[0]) == 3
    assert t.count[1:5].tolist() == [30, 0, 2, 1]
    t.buf[:3] = torch.arange(3.0)[:, None]
    step = CaptureStep(StepRows(t.buf[:3].clone(), t.labels[:3, :3].clone(), t.count.clone(),
                                {0: "big", 2: "small", 3: "other"}, {}, {0: "s0", 1: "s1"},
                                t.rows, OverflowKind.CAPTURE_ROWS))
    step.formats = {2: {1: _fmt()}, 3: {0: _fmt()}}
    out = {r: unpack(c) for r, c in step.per_request().items()}
    assert Overflow.from_tensor(out["big"][OVERFLOW]).wanted == 30 and len(out["big"]) == 1
    assert out["small"]["s1@positions"].tolist() == [0, 1]
    assert out["other"]["s0@positions"].tolist() == [0]


def _fmt():
    from graphtap.courier import RowFormat

    return RowFormat(torch.float32, 4, None, 0)
