"""GPU check of the host rings (engine/slots.py HostRing): the slot block's staged rows
and column runs, which the index copies read through their UVA view, and the staged
router's layout, copied in one call from a ring buffer, reach the device as the host
wrote them, also while the device runs behind the host by as many steps as the ring has
buffers (a sleep kernel first: the engine's async scheduling, at its worst). The router routes
as the torch router does, also where one graph replays the tokens' and a family's rows,
and where the graphs copy the layout and a runner's positions themselves and apply the
slot block's staged writes before they route the rows that read them (check_slot_fold),
and a small step's snapshot (host copies queued on the main stream) holds the step's
rows whatever the next step writes; a large step's rows, which go home on a stream of
their own after vLLM's copy event, are the step's when read right after that event.
Runs on the CPU too (Triton's interpreter, no pinning), as tests/test_route_staged.py's
CPU check of the same script.

    bash benchmarks/gpu/run_gpu.sh stagecheck   (after the bundle's install)

Exits 1 on a mismatch."""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np
import torch

from graphtap.courier.snapshot import SLOT_COLUMN
from graphtap.engine.router import TokenRouter
from graphtap.engine.slots import SlotBlock, SlotLayout
from graphtap.engine.tables import Sizes, allocate
from graphtap.ops.backend import TORCH, _triton

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DEPTH, SLOTS, TOKENS = 2, 16, 256


def lag() -> None:
    """The device behind the host: the next launches wait for a ~10 ms kernel."""
    if DEV.type == "cuda":
        torch.cuda._sleep(20_000_000)


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def check_slot_block(rounds: int = 40, seed: int = 0) -> int:
    """Mismatched elements of the device block after each round of DEPTH applies."""
    rng = np.random.default_rng(seed)
    layout = SlotLayout()
    ints = layout.reserve((3,), torch.int32, -1.0)
    floats = layout.reserve((2,), torch.float32, 0.5)
    block = SlotBlock(layout, SLOTS, DEV, staging_depth=DEPTH)
    group = block.group([ints, floats])
    bad = 0
    for _ in range(rounds):
        lag()
        for _ in range(DEPTH):  # the most the engine stages before the device reads
            for slot in rng.choice(SLOTS, int(rng.integers(1, SLOTS)), replace=False):
                block.reset(int(slot), group, claim=None)  # rewritten and staged
                block.host_view(ints)[slot] = rng.integers(0, 1000, 3)
                block.host_view(floats)[slot] = rng.normal(size=2)
            block.apply()
        sync()
        bad += int((block.gpu.cpu().numpy() != block.host).sum())
    return bad


def check_slot_runs(rounds: int = 40, seed: int = 0) -> int:
    """As check_slot_block, for column runs (SlotBlock.stage_runs, a row family's sites
    and bitmap words): slots claimed clean get random runs written, others released,
    and the device block must be the host's after each round."""
    rng = np.random.default_rng(seed)
    layout = SlotLayout()
    sites = layout.reserve((4,), torch.int32, -1.0)
    words = layout.reserve((4, 64), torch.int32, 0.0)
    block = SlotBlock(layout, SLOTS, DEV, staging_depth=DEPTH)
    group = block.group([sites, words])
    held: dict[int, np.ndarray] = {}
    bad = 0
    for _ in range(rounds):
        lag()
        for _ in range(DEPTH):
            for slot in (int(s) for s in rng.choice(SLOTS, int(rng.integers(1, SLOTS)),
                                                    replace=False)):
                if slot in held:
                    block.release_runs(slot, group, held.pop(slot))
                elif block.claim_clean(slot, group):
                    lo = int(rng.integers(0, 4 * 64 - 8))
                    runs = np.array([[sites.offset, sites.offset + 4],
                                     [words.offset + lo, words.offset + lo + 8]], np.int64)
                    for a, z in runs:
                        block.host[slot, a:z] = rng.integers(1, 1000, z - a)
                    block.stage_runs(slot, runs)
                    held[slot] = runs
            block.apply()
        sync()
        bad += int((block.gpu.cpu().numpy() != block.host).sum())
    return bad


def router_sizes(**kw) -> Sizes:
    """Tables for the router checks: one capture entry, SLOTS requests, TOKENS tokens."""
    return Sizes(**{**dict(max_reqs=SLOTS, max_tokens=TOKENS, max_len=512, num_sites=2,
                           hidden=64, steer_width=64, dtype=torch.float32, max_steers=1,
                           max_vectors=2, max_captures=1, capture_rows=8, capture_width=64,
                           pattern_rows=8, num_heads=2, patterns=False), **kw})


def random_step(rng, slots: np.ndarray, runner: torch.Tensor) -> SimpleNamespace:
    """A step of requests in `slots` (int32) with random prompt chunks, its positions
    written into the runner's buffer in stream order, as vLLM's prepare_inputs does."""
    reqs = len(slots)
    qsl = np.concatenate([[0], np.cumsum(rng.integers(1, TOKENS // SLOTS, reqs))]
                         ).astype(np.int32)
    n = int(qsl[-1])
    runner[:n].copy_(torch.from_numpy(rng.integers(0, 500, n)).to(DEV))
    return SimpleNamespace(
        req_ids=[f"r{s}" for s in slots], num_reqs=reqs, num_tokens=n,
        num_tokens_after_padding=n, query_start_loc_np=qsl,
        query_start_loc=torch.from_numpy(qsl).to(DEV), idx_mapping_np=slots,
        idx_mapping=torch.from_numpy(slots).to(DEV), positions=runner[:n])


def check_router(rounds: int = 40, seed: int = 0, graphs: bool = False) -> int:
    """Steps whose token routing differs from the torch router's, DEPTH steps a round.
    `graphs`: the router replays its graphs (CUDA graphs on a GPU), which copy the layout
    from the ring and the positions from a runner's buffer (written in stream order, as
    vLLM's prepare_inputs does), and tok_pos is compared too."""
    rng = np.random.default_rng(seed)
    sizes = router_sizes()
    staged = TokenRouter(allocate(sizes, _triton(False), DEV).ops, staging_depth=DEPTH)
    ref = TokenRouter(allocate(sizes, TORCH, DEV).ops)
    assert staged.staged and not ref.staged
    runner = torch.zeros(TOKENS, dtype=torch.int64, device=DEV)
    if graphs:
        staged.capture_graphs([], 512, capture=None if DEV.type == "cuda" else
                              (lambda body: SimpleNamespace(replay=body)))
        staged.learn_positions(runner[:1])
        staged.adopt_positions()
        assert staged.graphs is not None and staged._graph_pos is runner
    bad = 0
    for _ in range(rounds):
        lag()
        steps = []
        for _ in range(DEPTH):
            slots = rng.choice(SLOTS, int(rng.integers(1, SLOTS)),
                               replace=False).astype(np.int32)
            b = random_step(rng, slots, runner)
            n = b.num_tokens
            staged.route(b)
            # the staged router's tables as this step left them (its next step rewrites)
            steps.append((b, staged.tok_slot[:n].clone(), staged.tok_row[:n].clone(),
                          staged.t.tok_pos[:n].clone(), runner[:n].clone()))
        sync()
        for b, slot, row, pos, want in steps:
            ref.route(b)
            n = b.num_tokens
            bad += not (torch.equal(slot, ref.tok_slot[:n]) and
                        torch.equal(row, ref.tok_row[:n]) and torch.equal(pos, want))
    return bad


def check_slot_fold(rounds: int = 40, seed: int = 0) -> int:
    """Steps whose slot block or row routing differs from the reference, DEPTH steps a
    round under device lag: each step admits capture entries into random slots (whole
    rows, and column runs through the element ring), defers the staged writes
    (SlotBlock.apply(defer=True)) and routes its tokens and rows in one graph replay,
    which applies them first; the reference applies them at once and routes with the
    torch router. The row routing must read the step's new entries."""
    rng = np.random.default_rng(seed)
    sizes = router_sizes(max_captures=2, capture_rows=TOKENS, staging_depth=DEPTH)
    et, ref_et = allocate(sizes, _triton(False), DEV), allocate(sizes, TORCH, DEV)
    staged = TokenRouter(et.ops, staging_depth=DEPTH, slots=et.slots)
    ref = TokenRouter(ref_et.ops)
    runner = torch.zeros(TOKENS, dtype=torch.int64, device=DEV)
    staged.capture_graphs([et.ops.capture], 512, capture=None if DEV.type == "cuda" else
                          (lambda body: SimpleNamespace(replay=body)))
    staged.learn_positions(runner[:1])
    staged.adopt_positions()
    assert staged.takes_slot_writes()
    block, fields = et.slots, et.capture
    group = block.group([fields.site, fields.pos])
    held: dict[int, np.ndarray] = {}
    bad = 0
    for _ in range(rounds):
        lag()
        steps = []
        for _ in range(DEPTH):
            reqs = int(rng.integers(1, SLOTS))
            slots = rng.choice(SLOTS, reqs, replace=False).astype(np.int32)
            for slot in (int(s) for s in slots):
                if slot in held:  # its runs back to inactive first
                    block.release_runs(slot, group, held.pop(slot))
                site, word = int(rng.integers(0, 2)), int(rng.integers(0, 16))
                bits = int(rng.integers(1, 2**31))
                if rng.random() < 0.5 and block.claim_clean(slot, group):
                    w = fields.pos.offset + word
                    runs = np.array([[fields.site.offset, fields.site.offset + 1],
                                     [w, w + 1]], np.int64)
                    block.host[slot, runs[0, 0]] = site
                    block.host[slot, w] = bits
                    block.stage_runs(slot, runs)
                    held[slot] = runs
                else:
                    block.reset(slot, group, claim=True)
                    block.host_view(fields.site)[slot, 0] = site
                    block.host_view(fields.pos)[slot, 0, word] = bits
            block.apply(defer=True)
            b = random_step(rng, slots, runner)
            n = b.num_tokens
            staged.invalidate()
            staged.route(b, rows=et.ops.capture)
            staged.route_rows(et.ops.capture, b, 512)
            bad += block._pending is not None  # the replay took them
            block.flush()
            t = et.ops.capture
            steps.append((b, block.host.copy(), block.gpu.clone(), t.count.clone(),
                          t.labels.clone(), runner[:n].clone()))
        sync()
        for b, host, gpu, count, labels, positions in steps:
            rb = ref_et.slots
            rb.host[:] = host
            rb.gpu.copy_(torch.from_numpy(host))
            b.positions = positions
            ref.invalidate()
            ref.route(b)
            ref.route_rows(ref_et.ops.capture, b, 512)
            rt = ref_et.ops.capture
            used = min(int(rt.count[0]), rt.rows)
            bad += not (np.array_equal(gpu.cpu().numpy(), host) and
                        torch.equal(count.cpu(), rt.count.cpu()) and
                        torch.equal(labels[:used].cpu(), rt.labels[:used].cpu()))
    return bad


def capture_family(backend, hidden: int):
    """(tables, capture family) of resid_post at 2 layers, rows `hidden` floats wide."""
    from graphtap.engine.families.capture import CaptureFamily
    from graphtap.spec.sites import SiteTable, expand_patterns

    sites = SiteTable(expand_patterns(["blocks.*.hook_resid_post"], 2))
    sizes = Sizes(max_reqs=SLOTS, max_tokens=TOKENS, max_len=512, num_sites=len(sites),
                  hidden=hidden, steer_width=hidden, dtype=torch.float32, max_steers=1,
                  max_vectors=2, max_captures=2, capture_rows=2 * TOKENS,
                  capture_width=hidden, pattern_rows=8, num_heads=2, patterns=False)
    et = allocate(sizes, backend, DEV)
    return et, CaptureFamily(et.ops.capture, et.capture, et.slots,
                             widths={"resid_post": (hidden, 0)}, backend=backend,
                             sites=sites, max_len=512, model_dtype=torch.float32)


def prefill_batch(slots: np.ndarray, lengths: np.ndarray) -> SimpleNamespace:
    """The input batch of a step of prompts: request slot i's first lengths[i] tokens."""
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return SimpleNamespace(
        req_ids=[f"r{s}" for s in slots], num_reqs=len(slots), num_tokens=int(qsl[-1]),
        num_tokens_after_padding=int(qsl[-1]), query_start_loc_np=qsl,
        query_start_loc=torch.from_numpy(qsl).to(DEV), idx_mapping_np=slots,
        idx_mapping=torch.from_numpy(slots).to(DEV),
        num_computed_tokens_np=np.zeros(len(slots), np.int32),
        num_scheduled_tokens=lengths.astype(np.int32), num_draft_tokens_per_req=None,
        positions=torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])).to(DEV))


def check_snapshots(rounds: int = 20, seed: int = 0) -> int:
    """Steps whose capture snapshot differs from what the step wrote: a capture family
    routes each step's rows in the router's graphs (one replay with the tokens'), the
    step's rows are written, the family's snapshot takes them (small steps: host copies
    on the main stream, RowFamily.snapshot), and the next step overwrites the buffers at
    once, the device lagging. Its labels and count must equal the torch router's, its
    rows the written values."""
    from graphtap.spec import CaptureEntry, NormalisedSpec

    rng = np.random.default_rng(seed)
    families = []
    for backend in (_triton(False), TORCH):
        et, family = capture_family(backend, 64)
        router = TokenRouter(et.ops, staging_depth=DEPTH)
        # the family under test: host copies queued in the snapshot; the reference (the
        # torch router's): device clones copied home later, RowFamily.snapshot's other way
        if router.staged:
            router.capture_graphs([et.ops.capture], 512, capture=None if DEV.type == "cuda"
                                  else lambda body: SimpleNamespace(replay=body))
        else:
            family.home_bytes = 0
        families.append((et, family, router))
    rules = ["all", "last_prompt", "prompt"]
    bad = 0
    for step in range(rounds):
        reqs = int(rng.integers(1, SLOTS))
        lengths = rng.integers(1, TOKENS // SLOTS, reqs)
        slots = rng.choice(SLOTS, reqs, replace=False).astype(np.int32)
        spec = NormalisedSpec(capture=tuple(
            CaptureEntry(layer, "resid_post", f"blocks.{layer}.hook_resid_post", "model",
                         None, rules[int(rng.integers(3))]) for layer in (0, 1)))
        b = prefill_batch(slots, lengths)
        snaps = []
        for et, family, router in families:
            for s, n in zip(slots, lengths):
                family.add_request(int(s), f"r{s}", int(n), spec)
            et.slots.apply()
            lag()
            plan = family.plan(b)
            router.route(b, rows=family.rows_to_route(plan))
            family.route(b, router, plan)
            t = et.ops.capture
            t.buf.copy_(torch.arange(t.buf.numel(), device=DEV, dtype=t.buf.dtype)
                        .view_as(t.buf) + step)  # the step's rows
            snap = family.snapshot()
            t.buf.fill_(-1.0), t.labels.fill_(-7), t.count.zero_()  # the next step's
            snap.to_cpu_nonblocking()
            snaps.append(snap)
            for s in slots:
                family.remove_request(f"r{s}")
            et.slots.apply()
        sync()
        (graph, ref) = snaps
        wanted = sum(int(n) if e.positions != "last_prompt" else 1
                     for n in lengths for e in spec.capture)
        used = int(ref.count[0])
        expect = (torch.arange(ref.rows.shape[0] * 64, dtype=torch.float32)
                  .view(-1, 64) + step)[:used]
        bad += not (used == wanted and graph.home and not ref.home and
                    torch.equal(graph.count, ref.count.cpu()) and
                    torch.equal(graph.labels[:used], ref.labels[:used].cpu()) and
                    torch.equal(graph.rows[:used].cpu(), expect))
    return bad


def check_rows_stream(rounds: int = 20, hidden: int = 4096) -> tuple[int, int]:
    """(bad steps, steps whose tokens' copy event came before their rows were home): a
    large step's rows (2 sites x TOKENS positions of `hidden` floats, 8 MiB) go home on
    the family's own stream while its labels and count ride a stand-in for vLLM's
    output copy stream, the device lagging and the next step overwriting the buffers at
    once; read right after the copy event, without a device sync, rows, labels and
    count must be the step's (LabelledStep.rows waits for the rows' own event)."""
    from graphtap.spec import CaptureEntry, NormalisedSpec

    et, family = capture_family(TORCH, hidden)
    router = TokenRouter(et.ops, staging_depth=DEPTH)
    copy_stream = torch.cuda.Stream() if DEV.type == "cuda" else None
    spec = NormalisedSpec(capture=tuple(
        CaptureEntry(layer, "resid_post", f"blocks.{layer}.hook_resid_post", "model", None,
                     "all") for layer in (0, 1)))
    reqs, each = SLOTS // 2, TOKENS // (SLOTS // 2)
    slots = np.arange(reqs, dtype=np.int32)
    b = prefill_batch(slots, np.full(reqs, each))
    for s in slots:
        family.add_request(int(s), f"r{s}", each, spec)
    et.slots.apply()
    bad = early = 0
    for step in range(rounds):
        plan = family.plan(b)
        router.route(b)
        family.route(b, router, plan)
        t = et.ops.capture
        lag()
        t.buf.copy_(torch.arange(t.buf.numel(), device=DEV, dtype=t.buf.dtype)
                    .view_as(t.buf) + step)  # the step's rows, late
        snap = family.snapshot()
        t.buf.fill_(-1.0), t.labels.fill_(-7), t.count.zero_()  # the next step's
        if copy_stream is None:
            snap.to_cpu_nonblocking()
        else:  # AsyncOutput: its copies, then the copy event, on its copy stream
            copy_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(copy_stream):
                snap.to_cpu_nonblocking()
                event = torch.cuda.Event(blocking=True)
                event.record(copy_stream)
            event.synchronize()
            early += snap.rows_ready is not None and not snap.rows_ready.query()
        used = int(snap.count[0])
        expect = (torch.arange(t.buf.numel(), dtype=torch.float32).view(t.buf.shape)
                  + step)[:used]
        bad += not (used == 2 * TOKENS and not snap.home and
                    torch.equal(snap.rows[:used], expect) and
                    bool((snap.labels[:used, SLOT_COLUMN] >= 0).all()))
    sync()
    return bad, early


def main() -> int:
    bad, early = check_rows_stream()
    found = {"slot_block_mismatches": check_slot_block(),
             "slot_runs_mismatches": check_slot_runs(), "router_bad_steps": check_router(),
             "router_graphs_bad_steps": check_router(graphs=True),
             "slot_fold_bad_steps": check_slot_fold(),
             "snapshot_bad_steps": check_snapshots(), "rows_stream_bad_steps": bad,
             "rows_home_after_tokens_steps": early,
             "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"}
    ok = found["slot_block_mismatches"] == 0 and found["slot_runs_mismatches"] == 0 and \
        found["router_bad_steps"] == 0 and \
        found["router_graphs_bad_steps"] == 0 and found["slot_fold_bad_steps"] == 0 and \
        found["snapshot_bad_steps"] == 0 and bad == 0
    print(json.dumps({**found, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
