"""Torch's pinned host pool, filled at engine start with the block sizes a step's copies
home will ask for.

Why: a capture step's rows, labels and count go home into pinned host memory (a
non_blocking copy to the CPU, or host_copies for a small step), which torch's caching host
allocator hands out in power-of-two blocks and keeps once freed. A size it has not held
yet is a cudaHostAlloc on the engine core's busy loop, milliseconds for a few MiB, and
every request of the batch waits for it: on H100 and H200 hosts (sessions 37-39, five
launches) the first burst of 64 qk requests after start spent 15-26 ms in five to_cpu
calls of 1.3-10.3 ms each, the first hs burst one 2.1-2.3 ms collect, and later bursts a
2-3 ms call now and then, where a larger step or one more block in flight than before
needed one (a device trace put a cudaHostAlloc of 2.9 ms inside such a to_cpu).
Allocating and freeing the blocks once at start leaves them in the pool's free lists,
so those steps find them there.

The warm-up at init alone did not hold: on the H100 (s40, s41) the first qk burst still
created 6 blocks (50 MiB in all, 17-25 ms) and the first hs burst 13 small ones, the
same with eight blocks of each size warmed as with four. torch.cuda.graph empties the
host cache as each capture begins (torch._C._host_emptyCache, torch/cuda/graphs.py),
and vLLM captures its graphs after the hook manager's init; so the manager warms the
pool again once vLLM has captured them (HookManager.after_capture, patch 0003). On the
H100 (s42 c, d) the first qk burst then created no block, the first hs burst 2 small ones."""
from __future__ import annotations

from collections.abc import Callable

import torch

FLOOR = 512  # bytes: a step's count (a few hundred bytes) is the smallest copy home
DEPTH = 4  # blocks per size: a step's copies in flight (deferred splits, the next steps)


def buckets(max_bytes: int, floor: int = FLOOR) -> list[int]:
    """The power-of-two block sizes from `floor` up to the one that holds `max_bytes`."""
    out = [floor]
    while out[-1] < max_bytes:
        out.append(out[-1] * 2)
    return out


def warm_plan(max_bytes: int, budget: int, depth: int = DEPTH) -> list[int]:
    """The sizes to warm, smallest first, `depth` blocks each, while they fit `budget`
    bytes (the largest, rarest steps' sizes are the ones left out)."""
    plan, used = [], 0
    for size in buckets(max_bytes):
        if used + depth * size > budget:
            break
        plan.append(size)
        used += depth * size
    return plan


def warm_pinned_pool(max_bytes: int, budget: int, depth: int = DEPTH,
                     alloc: Callable[[int], torch.Tensor] | None = None) -> int:
    """Allocates `depth` pinned blocks of each size of warm_plan, all held at once (so
    the pool makes `depth` of each, not one reused), then frees them into the pool.
    Returns the bytes warmed. `alloc`: the allocation (tests)."""
    alloc = alloc or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
    plan = warm_plan(max_bytes, budget, depth)
    held = [alloc(size) for size in plan for _ in range(depth)]
    del held
    return depth * sum(plan)
