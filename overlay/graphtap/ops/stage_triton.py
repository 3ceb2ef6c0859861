"""The slot block's staged writes inside the routing's graph replay (engine/slots.py,
engine/router.py): the same writes as SlotBlock.flush's index copies (the torch
reference), but which ring buffer and how many rows and elements are read from the
device, from a header the router's layout copy brings with the step's layout. So a
captured launch serves every step, and a step with new requests makes one device call
before its forward (the replay), not the replay and the index copies, each a distinct
call that after a quiet spell costs the engine core's host 0.1 ms or more (a burst's
first steps: benchmarks/gpu/first_step_host.py).

Grids are fixed per engine: a program per staged row (the ring's capacity, the slots)
and per block of elements; those past the header's counts return at once."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _staged_rows_kernel(block_ptr, hdr_ptr, index_ptr, values_ptr, width, capacity,
                        BLOCK: tl.constexpr):
    r = tl.program_id(0)
    if r >= tl.load(hdr_ptr + 1):
        return
    buf = tl.load(hdr_ptr).to(tl.int64)
    dst = tl.load(index_ptr + buf * capacity + r)
    src = values_ptr + (buf * capacity + r) * width
    for c in range(0, width, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        m = offs < width
        tl.store(block_ptr + dst * width + offs, tl.load(src + offs, mask=m), mask=m)


@triton.jit
def _staged_elements_kernel(flat_ptr, hdr_ptr, index_ptr, values_ptr, capacity,
                            BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < tl.load(hdr_ptr + 3)
    base = tl.load(hdr_ptr + 2).to(tl.int64) * capacity
    dst = tl.load(index_ptr + base + offs, mask=m, other=0)
    tl.store(flat_ptr + dst, tl.load(values_ptr + base + offs, mask=m), mask=m)


def apply_staged_triton(block: torch.Tensor, header: torch.Tensor,
                        rows: tuple[torch.Tensor, torch.Tensor],
                        elements: tuple[torch.Tensor, torch.Tensor]) -> None:
    """block: the int32 slot block [slots, width]; header: int32 device [4], the rows'
    ring buffer and count, then the elements' (SlotBlock.take_pending, staged with the
    router's layout); rows: the staged rows' rings (index [depth, R] int64, values
    [depth, R, width] int32) as the device reads them; elements: (index [depth, E]
    int64, values [depth, E] int32) over the flattened block."""
    index, values = rows
    capacity, width = values.shape[1], values.shape[2]
    _staged_rows_kernel[(capacity,)](block, header, index, values, width, capacity,
                                     BLOCK=BLOCK)
    index, values = elements
    capacity = values.shape[1]
    _staged_elements_kernel[(triton.cdiv(capacity, BLOCK),)](block, header, index, values,
                                                             capacity, BLOCK=BLOCK)
