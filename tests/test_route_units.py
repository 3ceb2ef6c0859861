"""Capture routing: the Triton kernels (Triton's interpreter here) against the torch
reference, which the CPU engine tests check end to end against HF."""
import copy

import pytest
import torch

from graphtap.tables import CaptureTables


def tables(seed: int, sites: int, rows: int, max_len: int = 100) -> CaptureTables:
    g = torch.Generator().manual_seed(seed)
    t = CaptureTables.allocate(max_reqs=6, max_tokens=96, max_captures=3, num_sites=sites,
                               rows=rows, hidden=4, max_len=max_len, device="cpu")
    for slot in range(6):  # slot 6 is the sentinel: never given entries
        chosen = torch.randperm(sites, generator=g)[:int(torch.randint(0, 4, (1,), generator=g))]
        t.cap_site[slot, :len(chosen)] = chosen.to(torch.int32)
        t.cap_pos[slot] = torch.randint(-2**31, 2**31 - 1, t.cap_pos[slot].shape, generator=g,
                                        dtype=torch.int64).to(torch.int32)
    return t


@pytest.mark.parametrize("n,rows", [(1, 500), (37, 500), (96, 500), (96, 20), (50, 0)],
                         ids=["one-token", "blocks", "full", "overflow", "no-room"])
def test_triton_routing_matches_the_reference(n, rows):
    from graphtap.ops.route import route_reference
    from graphtap.ops.route_triton import route_triton

    for seed in range(3):
        ref = tables(seed, sites=5, rows=rows)
        tri = copy.deepcopy(ref)
        g = torch.Generator().manual_seed(100 + seed)
        slot = torch.randint(0, 7, (n,), generator=g)  # 6 = sentinel (padding)
        positions = torch.randint(-3, 130, (n,), generator=g)  # clamped to [0, 100)
        route_reference(ref, slot, positions, 100)
        route_triton(tri, slot, positions.to(torch.int32), 100, block=16)
        assert torch.equal(tri.cap_dst[:, :n], ref.cap_dst[:, :n]), seed
        assert tri.count.item() == ref.count.item()
        used = min(ref.count.item(), rows)
        assert torch.equal(tri.meta[:used], ref.meta[:used]), seed
        assert (tri.meta[used:rows, 0] == -1).all()
    assert ref.count.item() > 0  # the tables do route something


def test_triton_routing_with_nothing_wanted_routes_every_row_to_the_trash():
    from graphtap.ops.route_triton import route_triton

    t = tables(0, sites=4, rows=50)
    t.cap_dst.fill_(7)
    route_triton(t, torch.full((40,), 6), torch.arange(40), 100, block=16)  # all sentinel
    assert (t.cap_dst[:, :40] == 50).all() and t.count.item() == 0


@pytest.mark.parametrize("n", [1, 17, 64, 90], ids=["one", "blocks", "exact", "padding"])
def test_triton_token_routing_matches_the_reference(n):
    """Each token row's slot and batch row (searchsorted over the query start locations),
    padding rows past the last request's tokens to the sentinel."""
    from graphtap.ops.route import route_tokens_reference
    from graphtap.ops.route_triton import route_tokens_triton
    from graphtap.tables import SteerTables

    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        ref = SteerTables.allocate(max_reqs=8, max_tokens=96, max_steers=1, max_vectors=1,
                                   hidden=4, max_len=64, dtype=torch.float32, device="cpu")
        tri = copy.deepcopy(ref)
        num_reqs = int(torch.randint(1, 9, (1,), generator=g))
        used = n if n != 90 else 70  # "padding": the last 20 rows belong to no request
        cuts = torch.sort(torch.randperm(used - 1, generator=g)[:num_reqs - 1] + 1).values \
            if used > 1 and num_reqs > 1 else torch.tensor([], dtype=torch.int64)
        num_reqs = len(cuts) + 1
        qsl = torch.cat([torch.tensor([0]), cuts, torch.tensor([used])]).to(torch.int32)
        qsl = torch.cat([qsl, torch.full((3,), used, dtype=torch.int32)])  # stale tail
        idx = torch.randperm(8, generator=g)[:num_reqs]
        route_tokens_reference(ref, qsl, idx, n, num_reqs)
        route_tokens_triton(tri, qsl, idx, n, num_reqs, block=16)
        assert torch.equal(tri.tok_slot, ref.tok_slot), (seed, qsl, idx)
        assert torch.equal(tri.tok_row, ref.tok_row), seed
        assert (ref.tok_slot[used:n] == ref.sentinel).all()


def test_torch_routing_switch(monkeypatch):
    from graphtap.ops.route import torch_routing

    monkeypatch.delenv("GRAPHTAP_TORCH_ROUTING", raising=False)
    assert not torch_routing()
    monkeypatch.setenv("GRAPHTAP_TORCH_ROUTING", "1")
    assert torch_routing()
