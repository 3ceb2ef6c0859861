"""The token router: per step, each token row's request slot and batch row, on the
device, once for every family (steering reads it directly; row families route their
units from it). Padding rows and steps nobody acts in map to the sentinel slot.

Where the routing kernels read the request count from the device (Triton), the router
stages the step's layout and positions into buffers of its own first, so that its
launches and the row families' read fixed addresses only; on a GPU they are then
replayed from CUDA graphs captured at start (engine/route_graphs.py)."""
from __future__ import annotations

import torch

from graphtap.engine import route_graphs
from graphtap.engine.slots import HostRing
from graphtap.ops.tables import OpTables, RowTables


class TokenRouter:
    """The step's token row -> (request slot, batch row) map, kept in OpTables."""

    def __init__(self, tables: OpTables, positions: bool = False, staging_depth: int = 2):
        self.t = tables
        self.positions = positions  # keep tok_pos (ops at slots without positions)
        self._last_layout: tuple | None = None
        self._idle = True
        self.graphs: route_graphs.RouteGraphs | None = None
        self.replays = 0  # graph replays so far (stats: proof the engine used them)
        self._rows_done: int | None = None  # the row tables routed with this step's tokens
        self.staged = tables.backend.device_counts
        if self.staged:
            # The batch's layout at fixed addresses (route_tokens_triton): the request
            # count, query_start_loc and idx_mapping in one block, written on the host
            # from the batch's host arrays and copied in one call (three launches before)
            device, slots = tables.tok_slot.device, tables.sentinel + 1
            self._layout = torch.zeros(2 * slots + 2, dtype=torch.int32, device=device)
            self._nreq, self._qsl, self._idx = \
                self._layout[:1], self._layout[1:slots + 2], self._layout[slots + 2:]
            self._ring = HostRing((2 * slots + 2,), torch.int32, device, staging_depth)
        if tables.backend.name != "torch":
            # Compile the kernel now, not in the first hooked step (only the sentinel
            # request, one token).
            if self.staged:
                self._qsl[1] = 1
                self._idx.fill_(tables.sentinel)
                self._nreq.fill_(1)
                self._launch_tokens(1)
            else:
                qsl = torch.tensor([0, 1], dtype=torch.int32, device=tables.tok_slot.device)
                self.t.backend.route_tokens(
                    self.t.tok_slot, self.t.tok_row, self.t.sentinel, qsl,
                    torch.full_like(self.t.tok_slot[:1], self.t.sentinel), 1, 1)
            self.deactivate(force=True)

    @property
    def tok_slot(self) -> torch.Tensor:
        return self.t.tok_slot

    @property
    def tok_row(self) -> torch.Tensor:
        return self.t.tok_row

    # ---------------------------------------------------------------- start
    def capture_graphs(self, row_tables: list[RowTables], max_len: int,
                       capture=None) -> None:
        """Capture the routing of every token bucket (a GPU with device counts; not
        with GRAPHTAP_ROUTING_GRAPHS=0). Called once, after every family exists.
        `capture`: RouteGraphs' (tests replay the bodies on CPU)."""
        if capture is None and not route_graphs.wanted(self.t.tok_slot.device,
                                                       self.t.backend):
            return
        rows = {id(t): (lambda n, t=t: self._launch_rows(t, n, max_len)) for t in row_tables}
        self.graphs = route_graphs.RouteGraphs.build(self.t.tok_slot.shape[0],
                                                     self._launch_tokens, rows, capture)
        self.deactivate(force=True)

    # ---------------------------------------------------------------- launches
    def _launch_tokens(self, n: int) -> None:
        self.t.backend.route_tokens(self.t.tok_slot, self.t.tok_row, self.t.sentinel,
                                    self._qsl, self._idx, n, self._nreq)

    def _launch_rows(self, t: RowTables, n: int, max_len: int) -> None:
        self.t.backend.route_rows(t, self.t.tok_slot[:n], self.t.tok_row[:n],
                                  self.t.tok_pos[:n], max_len)

    # ---------------------------------------------------------------- steps
    def route(self, input_batch, positions: bool = True,
              rows: RowTables | None = None) -> None:
        """Map the step's token rows; `positions`: the step reads tok_pos (head steering;
        staged row routing, which reads them there), so copy them too (they move every
        step, whatever the layout). Unstaged row routing reads the batch's own. `rows`:
        the tables of the one row family that routes this step, whose routing a graph
        replays with the tokens' (its route_rows then has nothing left to do)."""
        n = input_batch.num_tokens_after_padding
        self._rows_done = None
        if positions and (self.staged or self.positions):
            self.t.tok_pos[:n].copy_(input_batch.positions[:n], non_blocking=True)
        layout = (tuple(input_batch.req_ids), input_batch.num_tokens, n,
                  input_batch.query_start_loc_np[: input_batch.num_reqs + 1].tobytes())
        if layout == self._last_layout:
            return  # same requests, same token rows: the table already says this
        num_reqs = input_batch.num_reqs
        if not self.staged:
            self.t.backend.route_tokens(self.t.tok_slot, self.t.tok_row, self.t.sentinel,
                                        input_batch.query_start_loc,
                                        input_batch.idx_mapping, n, num_reqs)
        else:
            self._stage_layout(input_batch, num_reqs)
            if self.graphs is not None:
                if rows is not None:
                    self.graphs.tokens_and_rows(id(rows), n)
                    self._rows_done = id(rows)
                else:
                    self.graphs.tokens(n)
                self.replays += 1
            else:
                self._launch_tokens(n)
        self._last_layout = layout
        self._idle = False

    def _stage_layout(self, input_batch, num_reqs: int) -> None:
        host, layout = self._ring.take()
        slots = self._idx.shape[0]
        layout[0] = num_reqs
        layout[1:num_reqs + 2] = input_batch.query_start_loc_np[:num_reqs + 1]
        layout[slots + 2:slots + 2 + num_reqs] = input_batch.idx_mapping_np[:num_reqs]
        self._layout.copy_(host, non_blocking=True)

    def route_rows(self, t: RowTables, input_batch, max_len: int) -> None:
        """A row family's units of this step (after `route`)."""
        n = input_batch.num_tokens_after_padding
        if self.graphs is not None:
            if self._rows_done == id(t):  # replayed with the tokens' (route)
                self._rows_done = None
                return
            self.graphs.rows(id(t), n)
            self.replays += 1
        elif self.staged:
            self._launch_rows(t, n, max_len)
        else:
            self.t.backend.route_rows(t, self.t.tok_slot[:n], self.t.tok_row[:n],
                                      input_batch.positions[:n], max_len)

    def stats(self) -> dict:
        return {"graph_buckets": len(self.graphs.sizes) if self.graphs is not None else 0,
                "graph_replays_total": self.replays}

    def deactivate(self, force: bool = False) -> None:
        self._rows_done = None
        if force or not self._idle:
            self.t.tok_slot.fill_(self.t.sentinel)
            self._idle = True
            self._last_layout = None

    def invalidate(self) -> None:
        """A slot's meaning changed (a new request): the next step routes again."""
        self._last_layout = None
