"""The courier's split of an attention-pattern step, and the unpacking at finish.

A pattern row is one (query token, head) of one site: the op filled it with that head's
probabilities over key positions 0..position. Each request gets each row's causal part
(keys 0..position) as one flat ragged tensor, since pieces from different steps differ
in width; `unpack_patterns` turns the merged pieces into [rows, heads, keys] at finish.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from graphtap.courier.chunks import positions_key, ragged_key
from graphtap.courier.pack import pack
from graphtap.courier.snapshot import LabelledStep
from graphtap.ops.tables import Label

# plain ints: numpy indexes with them on every step
ORDER = (int(Label.SLOT), int(Label.SITE), int(Label.POSITION), int(Label.HEAD))
SLOT, SITE, POSITION, _ = ORDER
HOST_LABELS = len(ORDER)  # label columns a pattern step copies home


class PatternFormat(NamedTuple):
    """How a request gets one pattern site back."""

    dtype: torch.dtype
    heads: int  # how many query heads it chose


class PatternStep(LabelledStep):
    """A pattern step; labels (slot, site, position, head) per row."""

    def _gathered(self) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        for req, slot, site, labels, rows in self.groups(ORDER, SLOT, SITE):
            fmt = self.formats[slot][site]
            pos = labels[::fmt.heads, POSITION]
            width = int(pos.max()) + 1
            data = rows[:, :width].reshape(-1, fmt.heads, width)
            causal = torch.arange(width)[None, :] <= torch.from_numpy(pos)[:, None]
            ragged = data[causal[:, None, :].expand_as(data)]
            name = self.site_names[site]
            # Boolean indexing copied already: nothing here views the pinned step buffer.
            out.setdefault(req, {})[ragged_key(name)] = ragged.to(fmt.dtype)
            out[req][positions_key(name)] = torch.from_numpy(pos.copy())
        return out


def unpack_patterns(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Flat ragged rows (position, head, keys 0..position) -> [rows, heads, max position
    + 1], zeros after each row's position."""
    keys = positions.long() + 1
    total = int(keys.sum())
    if total == 0:
        return values.new_zeros((0, 0, 0))
    heads = values.numel() // total
    width = int(keys.max())
    out = values.new_zeros((len(keys), heads, width))
    causal = torch.arange(width)[None, :] < keys[:, None]
    out[causal[:, None, :].expand_as(out)] = values
    return out


class MassFormat(NamedTuple):
    """How a request gets one attention-mass site back."""

    heads: int  # how many query heads it chose
    spans: int


class MassStep(LabelledStep):
    """An attention-mass step; labels (slot, site, position, head) per row, each row the
    masses of its spans: per request and site [queries, heads, spans] float32, packed
    per format (pack.py: a focus guard's 4 sites were 8 tensors a request)."""

    def _gathered(self) -> dict[str, dict[str, torch.Tensor]]:
        found: dict[str, dict[MassFormat, list]] = {}
        for req, slot, site, labels, rows in self.groups(ORDER, SLOT, SITE):
            fmt = self.formats[slot][site]
            data = rows[:, :fmt.spans].reshape(-1, fmt.heads, fmt.spans)
            found.setdefault(req, {}).setdefault(fmt, []).append(
                (self.site_names[site], data.to(torch.float32), labels[::fmt.heads, POSITION]))
        out: dict[str, dict[str, torch.Tensor]] = {}
        for req, packs in found.items():
            chunk = out[req] = {}
            for sites in packs.values():  # pack's cat copies: no view of the step buffer
                chunk.update(pack(*map(list, zip(*sites))))
        return out
