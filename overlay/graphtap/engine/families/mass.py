"""Attention mass: per request, the chosen query heads' attention summed over key spans
at the query positions, computed on the device from q and the paged K cache
(ops/mass*.py), one buffer row of span sums per (query token, head). The Attention
Tracker's focus and in-context re-ranking read these few floats, not whole patterns."""
from __future__ import annotations

import torch

from graphtap.courier import OverflowKind
from graphtap.courier.patterns import HOST_LABELS, MassFormat, MassStep
from graphtap.engine.rows import RowFamily
from graphtap.engine.tables import MassFields
from graphtap.spec.entries import NormalisedSpec
from graphtap.spec.sites import PATTERN


class MassFamily(RowFamily):
    """Attention mass on spans; one buffer row per wanted (token, chosen head)."""

    name = "attention_mass"
    step_class = MassStep
    overflow_kind = OverflowKind.MASS_ROWS
    host_labels = HOST_LABELS

    def __init__(self, tables, fields: MassFields, slots, *args, **kwargs):
        super().__init__(tables, fields.entries, slots, *args, **kwargs)
        self.spans = fields.spans
        self.extra_fields = (fields.spans,)
        self.site_names = {i: f"mass:{n}" for i, n in self.site_names.items()}

    def entries(self, spec: NormalisedSpec) -> tuple:
        return spec.mass

    def kind_of(self, entry) -> str:
        return PATTERN

    def write_extra(self, slot: int, i: int, entry) -> None:
        view = self.slots.host_view
        view(self.fields.heads)[slot, i, list(entry.heads)] = 1
        view(self.spans)[slot, i, :len(entry.spans)] = [(s.start, s.end) for s in entry.spans]

    def describe(self, entry, dtype: torch.dtype) -> tuple[MassFormat, int]:
        return MassFormat(len(entry.heads), len(entry.spans)), len(entry.heads)

    def columns(self, slots, batch) -> int:
        return max((f.spans for s in slots for f in self._formats[s].values()), default=0)
