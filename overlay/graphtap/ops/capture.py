"""`graphtap::capture_resid_`: copy the residual stream's selected rows into the capture
buffer, at rows the scheduler chose on the device before the step.

Declared as mutating `x` (the residual half the model uses next) so that dead-code
elimination keeps it; it only reads x. Rows not captured go to the buffer's trash row, so
the op has no data-dependent shape and no host sync: it is safe inside CUDA graphs. Torch
(index_copy_) on CPU and the spec of truth; a Triton kernel on GPU (capture_triton.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from graphtap.tables import CaptureTables

_tables: CaptureTables | None = None


def bind_capture_tables(tables: CaptureTables | None) -> None:
    global _tables
    _tables = tables


def _capture(t: CaptureTables, x: torch.Tensor, other: torch.Tensor | None, site: int) -> None:
    if x.is_cuda:
        from graphtap.ops.capture_triton import capture_triton

        if capture_triton(t, x, other, site):
            return
    capture_reference(t, x, other, site)


def capture_reference(t: CaptureTables, x: torch.Tensor, other: torch.Tensor | None,
                      site: int) -> None:
    """Rows of x (+ other), flattened per token ([tokens, heads, head_dim] included),
    summed in float32 and stored in the buffer's dtype (as vLLM's fused add-norm does)."""
    n = x.shape[0]
    stream = x.reshape(n, -1).float()
    if other is not None:
        stream = stream + other.reshape(n, -1).float()
    t.buf.narrow(1, 0, stream.shape[1]).index_copy_(0, t.cap_dst[site, :n],
                                                   stream.to(t.buf.dtype))


@torch.library.custom_op("graphtap::capture_resid_", mutates_args=("x",))
def capture_resid_(x: torch.Tensor, other: Optional[torch.Tensor], site: int) -> None:
    if _tables is not None:
        _capture(_tables, x, other, site)


@capture_resid_.register_fake
def _(x, other, site) -> None:
    return None


@torch.library.custom_op("graphtap::capture_into_", mutates_args=("sink",))
def capture_into_(sink: torch.Tensor, x: torch.Tensor, site: int) -> None:
    """Capture x (q, k or v before attention); `sink` is the attention output buffer,
    declared mutated (and left alone) so that the op survives dead-code elimination."""
    if _tables is not None:
        _capture(_tables, x, None, site)


@capture_into_.register_fake
def _(sink, x, site) -> None:
    return None
