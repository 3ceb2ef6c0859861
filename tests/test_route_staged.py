"""The router's staged routing (engine/router.py): with the Triton kernels the step's
layout, positions and request count are copied into the router's own buffers and the
launches read only those, so that one CUDA graph per token bucket serves every batch
(engine/route_graphs.py). Here, on CPU (Triton's interpreter), the staged router, and
the staged router replaying its bodies at the bucket's size as a graph would, route
every step of a sequence exactly as the torch router does."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from graphtap.engine.route_graphs import RouteGraphs, buckets
from graphtap.engine.router import TokenRouter
from graphtap.engine.tables import allocate
from graphtap.ops.backend import TORCH
from graphtap.ops.tables import Label
from helpers import sizes

SLOTS, TOKENS, HEADS, MAX_LEN = 6, 96, 4, 100


def engine(backend, seed: int = 0):
    """Tables with the same random capture and pattern entries for every backend."""
    et = allocate(sizes(max_reqs=SLOTS, max_tokens=TOKENS, max_captures=3, num_sites=5,
                        capture_rows=60, pattern_rows=60, capture_width=4, num_heads=HEADS,
                        max_len=MAX_LEN), backend, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for t in (et.ops.capture, et.ops.pattern):
        for slot in range(SLOTS):
            chosen = torch.randperm(5, generator=g)[:int(torch.randint(1, 4, (1,), generator=g))]
            t.entry_site[slot, :len(chosen)] = chosen.to(torch.int32)
            t.entry_pos[slot] = torch.randint(-2**31, 2**31 - 1, t.entry_pos[slot].shape,
                                              generator=g, dtype=torch.int64).to(torch.int32)
            if t.entry_heads is not None:
                t.entry_heads[slot] = torch.randint(0, 2, t.entry_heads[slot].shape,
                                                    generator=g, dtype=torch.int32)
    return et


def batch(lengths: list[int], slots: list[int], padded: int, seed: int):
    """A step's batch as the runner hands it over: requests of `lengths` tokens in slots
    `slots`, padded to `padded` token rows (the padding's positions are garbage)."""
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 200, (padded,), generator=g)
    return SimpleNamespace(
        req_ids=[f"s{s}" for s in slots], num_reqs=len(slots), num_tokens=int(qsl[-1]),
        num_tokens_after_padding=padded, query_start_loc_np=qsl,
        # vLLM's persistent buffers hold stale values past the batch's requests
        query_start_loc=torch.cat([torch.from_numpy(qsl), torch.tensor([7, 3], dtype=torch.int32)]),
        idx_mapping=torch.tensor(slots + [2, 1], dtype=torch.int32),
        idx_mapping_np=np.array(slots + [2, 1], np.int32), positions=positions)


STEPS = [  # (lengths, slots, padded): a new layout, the same layout (its token routing
    # cached), more requests, padding, then a smaller step after a larger one
    ([10, 17, 10], [3, 0, 5], 40),
    ([10, 17, 10], [3, 0, 5], 40),
    ([30, 1, 20, 25, 14], [1, 2, 3, 4, 5], 96),
    ([1], [4], 1),
    ([2, 3], [0, 1], 8),
]


def graphs_on_cpu(body):
    return SimpleNamespace(replay=body)  # what a CUDA graph of the body does on replay


@pytest.mark.parametrize("graphs", [False, True], ids=["staged", "bucket-replay"])
def test_staged_routing_routes_every_step_like_the_torch_router(graphs):
    from graphtap.ops.backend import _triton

    ref_et, tri_et = engine(TORCH), engine(_triton(False))
    ref, tri = TokenRouter(ref_et.ops), TokenRouter(tri_et.ops)
    assert tri.staged and not ref.staged
    if graphs:
        tri.capture_graphs([tri_et.ops.capture, tri_et.ops.pattern], MAX_LEN,
                           capture=graphs_on_cpu)
        assert tri.graphs is not None and tri.graphs.sizes == [TOKENS]
    routed = 0
    for i, (lengths, slots, padded) in enumerate(STEPS):
        b = batch(lengths, slots, padded, seed=i)
        ref.route(b)
        tri.route(b)
        n = padded
        assert torch.equal(tri.tok_slot[:n], ref.tok_slot[:n]), i
        assert torch.equal(tri.tok_row[:n], ref.tok_row[:n]), i
        for family in ("capture", "pattern"):
            rt, tt = getattr(ref_et.ops, family), getattr(tri_et.ops, family)
            ref.route_rows(rt, b, MAX_LEN)
            tri.route_rows(tt, b, MAX_LEN)
            if rt.dst is not None:
                assert torch.equal(tt.dst[:, :n], rt.dst[:, :n]), (i, family)
            assert torch.equal(tt.count, rt.count) and torch.equal(tt.fits, rt.fits), i
            used = min(int(rt.count[0]), rt.rows)
            assert torch.equal(tt.labels[:used], rt.labels[:used]), (i, family)
            assert (tt.labels[used:, Label.SITE] == -1).all()
            routed += used
    assert routed > 0


def test_idle_then_routing_again():
    """After an idle step (every row to the sentinel) the same layout routes again."""
    from graphtap.ops.backend import _triton

    et = engine(_triton(False))
    router = TokenRouter(et.ops)
    b = batch([5, 6], [2, 3], 16, seed=0)
    router.route(b)
    first = et.ops.tok_slot.clone()
    router.deactivate()
    assert (et.ops.tok_slot == SLOTS).all()
    router.route(b)
    assert torch.equal(et.ops.tok_slot, first)


def test_buckets_cover_every_token_count():
    assert buckets(8192, 1024) == [1024, 2048, 4096, 8192]
    assert buckets(2560, 1024) == [1024, 2048, 2560]
    assert buckets(96, 1024) == [96]
    g = RouteGraphs([1024, 2048, 2560], lambda n: None, {}, capture=graphs_on_cpu)
    assert [g.sizes[g.bucket(n)] for n in (1, 1024, 1025, 2049, 2560)] == \
        [1024, 1024, 2048, 2560, 2560]


def test_positions_are_staged_only_when_the_step_reads_them():
    """The staged router copies the step's positions into tok_pos where asked (a row
    family routes, or a z op steers: both read them there), and leaves them otherwise
    (residual steering reads the model's own)."""
    from graphtap.ops.backend import _triton

    et = engine(_triton(False))
    router = TokenRouter(et.ops)
    b = batch([5, 6], [2, 3], 16, seed=0)
    et.ops.tok_pos.fill_(-1)
    router.route(b, positions=False)
    assert (et.ops.tok_pos == -1).all()
    router.route(b, positions=True)
    assert torch.equal(et.ops.tok_pos[:16], b.positions[:16])


def test_the_gpu_staging_check_passes_on_the_cpu():
    """benchmarks/gpu/check_staging.py's checks, here on the CPU (copies are synchronous:
    the device's lag is the GPU run's to show), so the script never rots."""
    from benchmarks.gpu.check_staging import (check_router, check_rows_stream,
                                              check_slot_block, check_slot_fold,
                                              check_slot_runs, check_snapshots)

    assert check_slot_block(rounds=5) == 0
    assert check_slot_runs(rounds=5) == 0
    assert check_router(rounds=5) == 0
    assert check_router(rounds=5, graphs=True) == 0
    assert check_slot_fold(rounds=3) == 0
    assert check_snapshots(rounds=5) == 0
    assert check_rows_stream(rounds=3) == (0, 0)


def counted_routers():
    """(torch tables, Triton tables, their routers, the replays so far): the staged
    router's graphs are its bodies, each replay counted."""
    from graphtap.ops.backend import _triton

    ref_et, tri_et = engine(TORCH), engine(_triton(False))
    ref, tri = TokenRouter(ref_et.ops), TokenRouter(tri_et.ops)
    replayed = []

    def counting(body):
        return SimpleNamespace(replay=lambda: (replayed.append(1), body()))

    tri.capture_graphs([tri_et.ops.capture, tri_et.ops.pattern], MAX_LEN, capture=counting)
    return ref_et, tri_et, ref, tri, replayed


def test_one_familys_rows_replay_with_the_tokens():
    """A step whose rows one family routes (route(rows=...)) replays one graph for the
    tokens and those rows where the layout is new, and routes exactly as the torch
    router; the same layout again replays that family's rows alone, and another
    family's rows still replay on their own."""
    ref_et, tri_et, ref, tri, replayed = counted_routers()
    replayed.clear()
    for i, (lengths, slots, padded) in enumerate(STEPS):
        b = batch(lengths, slots, padded, seed=i)
        before = len(replayed)
        ref.route(b)
        tri.route(b, rows=tri_et.ops.capture)
        ref.route_rows(ref_et.ops.capture, b, MAX_LEN)
        tri.route_rows(tri_et.ops.capture, b, MAX_LEN)
        assert len(replayed) - before == 1, i  # tokens and rows, or the rows alone
        rt, tt = ref_et.ops.capture, tri_et.ops.capture
        assert torch.equal(tt.count, rt.count), i
        used = min(int(rt.count[0]), rt.rows)
        assert torch.equal(tt.labels[:used], rt.labels[:used]), i
        if i == 2:  # the pattern family's rows too: their own replay
            ref.route_rows(ref_et.ops.pattern, b, MAX_LEN)
            tri.route_rows(tri_et.ops.pattern, b, MAX_LEN)
            assert len(replayed) - before == 2
            assert torch.equal(tri_et.ops.pattern.count, ref_et.ops.pattern.count)


def test_graphs_copy_the_runners_positions_in_their_one_replay():
    """Once the router has learnt the runner's positions buffer (a dummy step's
    positions, a view of it) and captured its graphs again, a routing step is one
    replay: the layout's copy, the positions' copy and the routing. Steps route exactly
    as the torch router, tok_pos included; the same layout again still copies the
    positions (they move); a step whose positions are elsewhere launches the kernels
    instead, and routes the same."""
    ref_et, tri_et, ref, tri, replayed = counted_routers()
    runner = torch.full((TOKENS + 8,), -7, dtype=torch.int64)  # vLLM's persistent buffer
    tri.learn_positions(runner[:3])
    tri.adopt_positions()
    assert tri._graph_pos is runner
    tri_et.ops.tok_pos.fill_(-1)
    steps = STEPS + [STEPS[-1]]  # the last layout again, with other positions
    for i, (lengths, slots, padded) in enumerate(steps):
        b = batch(lengths, slots, padded, seed=i + 10)
        runner[:padded] = b.positions
        b.positions = runner[:padded]
        replayed.clear()
        ref.route(b)
        tri.route(b, rows=tri_et.ops.capture)
        ref.route_rows(ref_et.ops.capture, b, MAX_LEN)
        tri.route_rows(tri_et.ops.capture, b, MAX_LEN)
        assert len(replayed) == 1, i
        assert torch.equal(tri.tok_slot[:padded], ref.tok_slot[:padded]), i
        assert torch.equal(tri_et.ops.tok_pos[:padded], b.positions), i
        rt, tt = ref_et.ops.capture, tri_et.ops.capture
        assert torch.equal(tt.count, rt.count), i
        used = min(int(rt.count[0]), rt.rows)
        assert torch.equal(tt.labels[:used], rt.labels[:used]), i
    # positions elsewhere (not the buffer the graphs copy): the kernels, no replay
    lengths, slots, padded = STEPS[2]
    b = batch(lengths, slots, padded, seed=99)
    replayed.clear()
    ref.route(b)
    tri.route(b, rows=tri_et.ops.capture)
    ref.route_rows(ref_et.ops.capture, b, MAX_LEN)
    tri.route_rows(tri_et.ops.capture, b, MAX_LEN)
    assert replayed == []
    assert torch.equal(tri.tok_slot[:padded], ref.tok_slot[:padded])
    assert torch.equal(tri_et.ops.tok_pos[:padded], b.positions)
    assert torch.equal(tri_et.ops.capture.count, ref_et.ops.capture.count)
    # the same layout, positions not read (residual steering alone): nothing runs
    b.positions = runner[:padded]
    tri.route(b, positions=False)
    replayed.clear()
    tri.route(b, positions=False)
    assert replayed == []


def test_positions_are_learnt_only_from_a_prefix_of_a_large_enough_buffer():
    from graphtap.ops.backend import _triton

    et = engine(_triton(False))
    router = TokenRouter(et.ops)
    router.capture_graphs([et.ops.capture], MAX_LEN, capture=graphs_on_cpu)
    router.learn_positions(torch.zeros(TOKENS - 1, dtype=torch.int64)[:4])  # too small
    router.learn_positions(torch.zeros(2 * TOKENS, dtype=torch.int64)[4:9])  # not a prefix
    router.adopt_positions()
    assert router._graph_pos is None
    unrouted = TokenRouter(engine(_triton(False)).ops)  # no graphs: nothing to learn for
    unrouted.learn_positions(torch.zeros(TOKENS, dtype=torch.int64)[:4])
    assert unrouted._learnt is None
