"""The slot block's staged writes applied inside the routing's graph replay
(SlotBlock.apply(defer=True), TokenRouter.take_pending's header, ops/stage_triton.py):
the kernels write what the index copies (SlotBlock.flush, their reference) write, from
whichever ring buffer the header names; a step whose routing does not replay leaves
them to the manager's flush; nothing staged is ever lost or applied twice. On the CPU
(Triton's interpreter; the graphs are their bodies)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from graphtap.engine.router import TokenRouter
from graphtap.engine.slots import SlotBlock, SlotLayout
from graphtap.engine.tables import allocate
from helpers import sizes

pytest.importorskip("triton")


def block(depth: int = 3, words: int = 40) -> tuple[SlotBlock, object, object]:
    layout = SlotLayout()
    site = layout.reserve((2,), torch.int32, -1.0)
    bits = layout.reserve((2, words), torch.int32, 0.0)
    b = SlotBlock(layout, 8, torch.device("cpu"), staging_depth=depth)
    return b, b.group([site, bits]), (site, bits)


def stage_random(b: SlotBlock, group, rng) -> None:
    """Whole rows for some slots, column runs for others (claimed clean)."""
    for slot in (int(s) for s in rng.choice(8, int(rng.integers(1, 8)), replace=False)):
        if rng.random() < 0.5 and b.claim_clean(slot, group):
            lo = int(rng.integers(2, b.host.shape[1] - 3))
            runs = np.array([[0, 1], [lo, lo + 3]], np.int64)
            b.host[slot, 0] = int(rng.integers(0, 5))
            b.host[slot, lo:lo + 3] = rng.integers(1, 1000, 3)
            b.stage_runs(slot, runs)
        else:
            b.reset(slot, group, claim=True)
            b.host[slot] = rng.integers(-5, 1000, b.host.shape[1])


@pytest.mark.parametrize("seed", range(4))
def test_the_kernels_write_what_the_index_copies_write(seed):
    """Each step's deferred writes, applied by the kernels from the buffer the header
    names (the ring advancing through its depth), leave the device block equal to the
    host mirror, as flush's index copies do."""
    from graphtap.ops.stage_triton import apply_staged_triton

    rng = np.random.default_rng(seed)
    kern, group, _ = block()
    ref, ref_group, _ = block()
    for _ in range(7):
        state = rng.bit_generator.state
        stage_random(kern, group, rng)
        rng.bit_generator.state = state  # the same admissions for the reference
        stage_random(ref, ref_group, rng)
        kern.apply(defer=True)
        header = torch.tensor(kern.take_pending(), dtype=torch.int32)
        assert kern._pending is None
        apply_staged_triton(kern.gpu, header, kern.staging.rings(), kern.elements.rings())
        ref.apply()
        assert np.array_equal(ref.gpu.numpy(), ref.host)
        assert np.array_equal(kern.gpu.numpy(), kern.host)


def test_a_deferred_write_waits_for_its_taker_or_the_flush():
    b, group, (site, _) = block()
    b.reset(3, group, claim=True)
    b.host_view(site)[3] = (1, 2)
    b.apply(defer=True)
    assert b.gpu[3, :2].tolist() == [-1, -1]  # not yet
    b.flush()
    assert b.gpu[3, :2].tolist() == [1, 2]
    b.flush()  # nothing left: nothing written twice
    assert b.take_pending() == (0, 0, 0, 0)
    # a step that deferred and never reached its forward: the next apply writes it first
    b.reset(4, group, claim=True)
    b.host_view(site)[4] = (5, 6)
    b.apply(defer=True)
    b.reset(5, group, claim=True)
    b.host_view(site)[5] = (7, 8)
    b.apply(defer=True)
    assert b.gpu[4, :2].tolist() == [5, 6] and b.gpu[5, :2].tolist() == [-1, -1]
    b.flush()
    assert np.array_equal(b.gpu.numpy(), b.host)
    b.apply(defer=True)  # nothing staged: nothing pending
    assert b._pending is None


def routed(graphs: bool):
    from graphtap.ops.backend import _triton

    et = allocate(sizes(max_reqs=6, max_tokens=64, max_captures=2, num_sites=3,
                        capture_rows=64, capture_width=4, max_len=100), _triton(False),
                  torch.device("cpu"))
    router = TokenRouter(et.ops, slots=et.slots)
    runner = torch.zeros(72, dtype=torch.int64)
    if graphs:
        router.capture_graphs([et.ops.capture], 100,
                              capture=lambda body: SimpleNamespace(replay=body))
        router.learn_positions(runner[:1])
        router.adopt_positions()
    return et, router, runner


def step(slots: list[int], runner, positions=None):
    qsl = np.concatenate([[0], np.cumsum([4] * len(slots))]).astype(np.int32)
    n = int(qsl[-1])
    runner[:n] = torch.arange(n)
    return SimpleNamespace(
        req_ids=[f"r{s}" for s in slots], num_reqs=len(slots), num_tokens=n,
        num_tokens_after_padding=n, query_start_loc_np=qsl,
        query_start_loc=torch.from_numpy(qsl), idx_mapping_np=np.array(slots, np.int32),
        idx_mapping=torch.tensor(slots, dtype=torch.int32),
        positions=runner[:n] if positions is None else positions)


def admit(et, slot: int) -> None:
    """A capture entry at site 1 wanting positions 0-3."""
    f = et.capture
    et.slots.reset(slot, et.slots.group([f.site, f.pos]), claim=True)
    et.slots.host_view(f.site)[slot, 0] = 1
    et.slots.host_view(f.pos)[slot, 0, 0] = 0b1111


def test_a_replay_applies_the_writes_before_it_routes_the_rows_that_read_them():
    et, router, runner = routed(graphs=True)
    assert router.takes_slot_writes()
    admit(et, 2)
    et.slots.apply(defer=router.takes_slot_writes())
    assert et.slots._pending is not None
    router.route(step([2], runner), rows=et.ops.capture)
    assert et.slots._pending is None  # taken by the replay, which applied them
    assert np.array_equal(et.slots.gpu.numpy(), et.slots.host)
    assert int(et.ops.capture.count[0]) == 4  # its 4 positions routed at site 1


def test_writes_no_replay_took_are_the_flushs():
    """No graphs: nothing deferred. Graphs, but a step whose positions lie elsewhere
    (the kernels are launched): the writes stay pending for the manager's flush."""
    et, router, runner = routed(graphs=False)
    assert not router.takes_slot_writes()
    et, router, runner = routed(graphs=True)
    admit(et, 1)
    et.slots.apply(defer=True)
    elsewhere = torch.arange(8, dtype=torch.int64)
    router.route(step([1, 3], runner, positions=elsewhere), rows=et.ops.capture)
    assert et.slots._pending is not None
    et.slots.flush()
    assert np.array_equal(et.slots.gpu.numpy(), et.slots.host)


def test_capturing_the_graphs_again_never_replays_old_writes():
    """The capture runs each graph's body once to warm it, on whatever its ring buffer
    holds: a header a real step left there must not write its (by now old) rows again
    (adopt_positions captures again when the KV caches are bound anew)."""
    et, router, runner = routed(graphs=True)
    f = et.capture
    admit(et, 2)
    et.slots.apply(defer=True)
    router.route(step([2], runner), rows=et.ops.capture)  # the replay applies them
    et.slots.host_view(f.pos)[2, 0, 0] = 0b1  # then slot 2 changes, written at once
    et.slots.stage(2)
    et.slots.apply()
    tables, max_len, _ = router._graph_args
    # as cuda_graphs() captures: the body runs once first
    router._graph_args = (tables, max_len,
                          lambda body: (body(), SimpleNamespace(replay=body))[1])
    router._capture(runner)
    assert np.array_equal(et.slots.gpu.numpy(), et.slots.host)
