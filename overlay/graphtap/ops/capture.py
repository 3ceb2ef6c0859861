"""`graphtap::capture_resid_` and `graphtap::capture_into_`: copy a site's rows into the
capture buffer, at the rows the routing chose on the device before the step.

Declared as mutating a tensor the model uses next (the residual half, or the attention
output buffer) so that dead-code elimination keeps them; they only read it. Rows not
captured go to the buffer's trash row, so the ops have no data-dependent shape and no
host sync: they are safe inside CUDA graphs.
"""
from __future__ import annotations

from typing import Optional

import torch

from graphtap.ops.register import graph_op
from graphtap.ops.running import running_tables
from graphtap.ops.tables import RowTables


def capture_reference(t: RowTables, x: torch.Tensor, other: torch.Tensor | None,
                      site: int, col: int = 0) -> None:
    """Rows of x (+ other), flattened per token ([tokens, heads, head_dim] included),
    summed in float32 and stored in the buffer's dtype (as vLLM's fused add-norm does),
    from column `col` (this rank's heads' place in the row under tensor parallelism)."""
    n = x.shape[0]
    stream = x.reshape(n, -1).float()
    if other is not None:
        stream = stream + other.reshape(n, -1).float()
    t.buf.narrow(1, col, stream.shape[1]).index_copy_(0, t.dst[site, :n],
                                                      stream.to(t.buf.dtype))


@graph_op("capture_resid_", mutates=("x",))
def capture_resid_(x: torch.Tensor, other: Optional[torch.Tensor], site: int) -> None:
    t = running_tables("capture_resid_")
    t.backend.capture(t.capture, x, other, site, t.site_cols.get(site, 0))


@graph_op("capture_into_", mutates=("sink",))
def capture_into_(sink: torch.Tensor, x: torch.Tensor, site: int) -> None:
    """Capture x (q, k or v before attention); `sink` is the attention output buffer,
    declared mutated (and left alone) so that the op survives dead-code elimination."""
    t = running_tables("capture_into_")
    t.backend.capture(t.capture, x, None, site, t.site_cols.get(site, 0))
