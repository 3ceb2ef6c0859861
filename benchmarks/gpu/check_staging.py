"""GPU check of the host rings (engine/slots.py HostRing): the slot block's staged rows,
which the index copy reads through their UVA view, and the staged router's layout,
copied in one call from a pinned ring buffer, reach the device as the host wrote them,
also while the device runs behind the host by as many steps as the ring has buffers
(a sleep kernel first: the engine's async scheduling, at its worst). The router routes
as the torch router does. Runs on the CPU too (Triton's interpreter, no pinning), as
tests/test_route_staged.py's CPU check of the same script.

    bash benchmarks/gpu/run_gpu.sh stagecheck   (after the bundle's install)

Exits 1 on a mismatch."""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np
import torch

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


def check_router(rounds: int = 40, seed: int = 0) -> int:
    """Steps whose token routing differs from the torch router's, DEPTH steps a round."""
    rng = np.random.default_rng(seed)
    sizes = Sizes(max_reqs=SLOTS, max_tokens=TOKENS, max_len=512, num_sites=2, hidden=64,
                  steer_width=64, dtype=torch.float32, max_steers=1, max_vectors=2,
                  max_captures=1, capture_rows=8, capture_width=64, pattern_rows=8,
                  num_heads=2, patterns=False)
    staged = TokenRouter(allocate(sizes, _triton(False), DEV).ops, staging_depth=DEPTH)
    ref = TokenRouter(allocate(sizes, TORCH, DEV).ops)
    assert staged.staged and not ref.staged
    bad = 0
    for _ in range(rounds):
        lag()
        steps = []
        for _ in range(DEPTH):
            reqs = int(rng.integers(1, SLOTS))
            lengths = rng.integers(1, TOKENS // SLOTS, reqs)
            qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            slots = rng.choice(SLOTS, reqs, replace=False).astype(np.int32)
            b = SimpleNamespace(
                req_ids=[f"r{s}" for s in slots], num_reqs=reqs, num_tokens=int(qsl[-1]),
                num_tokens_after_padding=int(qsl[-1]), query_start_loc_np=qsl,
                query_start_loc=torch.from_numpy(qsl).to(DEV), idx_mapping_np=slots,
                idx_mapping=torch.from_numpy(slots).to(DEV),
                positions=torch.arange(int(qsl[-1]), device=DEV))
            staged.route(b)
            # the staged router's tables as this step left them (its next step rewrites)
            steps.append((b, staged.tok_slot[:b.num_tokens].clone(),
                          staged.tok_row[:b.num_tokens].clone()))
        sync()
        for b, slot, row in steps:
            ref.route(b)
            n = b.num_tokens
            bad += not (torch.equal(slot, ref.tok_slot[:n]) and torch.equal(row, ref.tok_row[:n]))
    return bad


def main() -> int:
    found = {"slot_block_mismatches": check_slot_block(), "router_bad_steps": check_router(),
             "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"}
    ok = found["slot_block_mismatches"] == 0 and found["router_bad_steps"] == 0
    print(json.dumps({**found, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
