"""Triton kernel for the capture ops: one program per token row, fixed launch config.
A row whose destination is the trash row returns after one load, so an idle site costs a
single small launch inside the graph (the torch reference launches several kernels)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphtap.ops.tables import RowTables


@triton.jit
def _capture_kernel(x_ptr, other_ptr, dst_ptr, buf_ptr, W, stride_x, stride_o, stride_b, TRASH,
                    HAS_OTHER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    dst = tl.load(dst_ptr + row)
    if dst != TRASH:
        offs = tl.arange(0, BLOCK)
        m = offs < W
        v = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_OTHER:
            v += tl.load(other_ptr + row * stride_o + offs, mask=m, other=0.0).to(tl.float32)
        # Triton's default for narrowing float casts rounds to nearest even, as torch
        # does (and vLLM's own fused add-norm); a no-op for a float32 buffer.
        v = v.to(buf_ptr.dtype.element_ty)
        tl.store(buf_ptr + dst * stride_b + offs, v, mask=m)


def rows_view(x: torch.Tensor) -> torch.Tensor | None:
    """x as [tokens, width] with unit inner stride, without copying, or None."""
    try:
        v = x.view(x.shape[0], -1)
    except RuntimeError:
        return None
    return v if v.stride(1) == 1 or v.shape[1] == 1 else None


def capture_triton(t: RowTables, x: torch.Tensor, other: torch.Tensor | None,
                   site: int, col: int = 0) -> bool:
    """Launch the kernel; False when the layout needs the torch path instead."""
    xv = rows_view(x)
    ov = rows_view(other) if other is not None else None
    if xv is None or (other is not None and ov is None):
        return False
    n, w = xv.shape
    if n == 0:
        return True
    block = triton.next_power_of_2(w)
    buf = t.buf[:, col:]  # this rank's slice of the rows starts there (same row stride)
    _capture_kernel[(n,)](xv, ov if ov is not None else xv, t.dst[site], buf, w,
                          xv.stride(0), ov.stride(0) if ov is not None else 0, buf.stride(0),
                          t.rows, HAS_OTHER=ov is not None, BLOCK=block,
                          num_warps=4 if block <= 2048 else 8)
    return True
