"""Capture: rows of residual and attention sites (q, k, v, z) copied out at the positions
each request asked for, returned per request by the courier."""
from __future__ import annotations

import torch

from graphtap.courier import CaptureStep, OverflowKind, RowFormat, columns
from graphtap.courier.rows import HOST_LABELS
from graphtap.engine.rows import RowFamily
from graphtap.spec.entries import NormalisedSpec


class CaptureFamily(RowFamily):
    """Row captures of residual and attention sites; one buffer row per wanted token."""

    name = "capture"
    step_class = CaptureStep
    overflow_kind = OverflowKind.CAPTURE_ROWS
    host_labels = HOST_LABELS

    def __init__(self, *args, widths: dict[str, tuple[int, int]], **kwargs):
        super().__init__(*args, **kwargs)
        self.widths = widths  # kind -> (row width, head_dim or 0)

    def entries(self, spec: NormalisedSpec) -> tuple:
        return spec.capture

    def kind_of(self, entry) -> str:
        return entry.kind

    def describe(self, entry, dtype: torch.dtype) -> tuple[RowFormat, int]:
        width, head_dim = self.widths[entry.kind]
        return RowFormat(dtype, width, entry.heads, head_dim), 1  # one row per token

    def add_request(self, slot: int, req_id: str, prompt_len: int,
                    spec: NormalisedSpec) -> None:
        super().add_request(slot, req_id, prompt_len, spec)
        if spec.capture:
            self._cols[slot] = max(map(columns, self._formats[slot].values()))

    def columns(self, slots, hi: int) -> int:
        # A row spans the widest configured site (Qwen2-1.5B: 1536 columns) where k rows
        # of 2 chosen heads read 256: copying whole rows home moved 6x the bytes of a qk
        # prefill step. Every request of the batch with entries counts, wanting rows now
        # or not, as in the step's attribution (RowFamily.route).
        return max((self._cols[s] for s in slots), default=0)
