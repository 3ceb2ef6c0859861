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
