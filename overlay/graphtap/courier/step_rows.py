"""What a row family hands the courier after a step (RowFamily.snapshot): the step's
rows, labels and count, and what the split needs to attribute them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from graphtap.courier.chunks import OverflowKind
from graphtap.ops.tables import LABELS


class Head(NamedTuple):
    """A step's count and labels in one block, count first (RowTables.head): they go
    home in one copy, not two (each device copy and pinned block is a call on the busy
    loop, which a burst's every first token waits behind)."""

    block: torch.Tensor  # count, then from `at` the used rows' labels, every column
    count_len: int  # count's length
    at: int  # where the labels begin
    columns: int  # the label columns the courier reads

    def parts(self, block: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(count, labels) as views of the block (or of its host copy)."""
        b = self.block if block is None else block
        # two as_strided calls, not four slices and views: half the time on the busy loop
        at = b.storage_offset()
        return b.as_strided((self.count_len,), (1,), at), b.as_strided(
            ((b.numel() - self.at) // LABELS, self.columns), (LABELS, 1), at + self.at)


@dataclass
class StepRows:
    """What a row family hands the courier after a step (device tensors, cloned, or
    host copies of a small step: `home`)."""

    rows: torch.Tensor  # [bound, columns] the step's used rows, the columns its formats read
    labels: torch.Tensor  # [bound, host label columns]
    count: torch.Tensor  # [1 + slots] rows the step wrote, then the units each slot wanted
    slot_to_req: dict[int, str]  # every request of the batch with entries in the family
    formats: dict[int, dict[int, tuple]]  # slot -> site -> the family's output format
    site_names: dict[int, str]
    capacity: int  # the buffer's rows
    overflow_kind: OverflowKind
    home: bool = False  # rows, labels and count are host copies already (queued)
    # a large step's rows go home on this stream, not vLLM's output copy stream (None:
    # on that one, or home already)
    stream: object = None
    # the device block count and labels are views of, copied home in one (None: two
    # tensors of their own, or home already)
    head: Head | None = None
