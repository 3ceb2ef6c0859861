"""A sink step's row labels on their way to the writer (courier/sink.py): the engine's
thread hands them over as they are, and the writer's thread makes the int64 arrays it
keeps."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SlotRequests:
    """Per-row request indices that the writer works out in its own thread: `table`
    (a step's slot -> request index, a copy) at `slot` (the step's slot labels, a view
    of its host copy). A harvest's step hands over 131072 rows of Llama-3-8B: gathering
    and copying its labels on the engine's thread held up the next step."""

    table: np.ndarray
    slot: np.ndarray

    def __len__(self) -> int:
        return len(self.slot)


def owned_int64(a) -> np.ndarray:
    """Labels as int64 arrays the writer keeps: views (of a step's host labels, which
    go back to torch's pinned cache once the step is done) are copied here, in the
    writer's thread."""
    if isinstance(a, SlotRequests):
        return a.table[a.slot]
    a = np.asarray(a)
    return a if a.dtype == np.int64 and a.base is None else np.array(a, np.int64)
