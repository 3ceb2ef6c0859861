"""The token router: per step, each token row's request slot and batch row, on the
device, once for every family (steering reads it directly; row families route their
units from it). Padding rows and steps nobody acts in map to the sentinel slot."""
from __future__ import annotations

import torch

from graphtap.ops.tables import OpTables


class TokenRouter:
    """The step's token row -> (request slot, batch row) map, kept in OpTables."""

    def __init__(self, tables: OpTables, positions: bool = False):
        self.t = tables
        self.positions = positions  # keep tok_pos (ops at slots without positions)
        self._last_layout: tuple | None = None
        self._idle = True
        if tables.backend.name != "torch":
            # Compile the kernel now, not in the first hooked step, with the batch's
            # dtypes (query start locations int32, batch row -> slot int64).
            device = tables.tok_slot.device
            qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
            self._launch(qsl, torch.full((1,), tables.sentinel, device=device), 1, 1)
            self.deactivate(force=True)

    @property
    def tok_slot(self) -> torch.Tensor:
        return self.t.tok_slot

    @property
    def tok_row(self) -> torch.Tensor:
        return self.t.tok_row

    def _launch(self, qsl, idx_mapping, n: int, num_reqs: int) -> None:
        self.t.backend.route_tokens(self.t.tok_slot, self.t.tok_row, self.t.sentinel, qsl,
                                    idx_mapping, n, num_reqs)

    def route(self, input_batch, positions: bool = True) -> None:
        """Map the step's token rows; `positions`: a request of the step needs tok_pos
        (head steering), so copy them too (they move every step, whatever the layout)."""
        n = input_batch.num_tokens_after_padding
        if self.positions and positions:
            self.t.tok_pos[:n].copy_(input_batch.positions[:n], non_blocking=True)
        layout = (tuple(input_batch.req_ids), input_batch.num_tokens, n,
                  input_batch.query_start_loc_np[: input_batch.num_reqs + 1].tobytes())
        if layout == self._last_layout:
            return  # same requests, same token rows: the table already says this
        self._launch(input_batch.query_start_loc, input_batch.idx_mapping, n,
                     input_batch.num_reqs)
        self._last_layout = layout
        self._idle = False

    def deactivate(self, force: bool = False) -> None:
        if force or not self._idle:
            self.t.tok_slot.fill_(self.t.sentinel)
            self._idle = True
            self._last_layout = None

    def invalidate(self) -> None:
        """A slot's meaning changed (a new request): the next step routes again."""
        self._last_layout = None
