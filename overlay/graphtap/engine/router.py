"""The token router: per step, each token row's request slot and batch row, on the
device, once for every family (steering reads it directly; row families route their
units from it). Padding rows and steps nobody acts in map to the sentinel slot.

Where the routing kernels read the request count from the device (Triton), the router
stages the step's layout and positions into buffers of its own first, so that its
launches and the row families' read fixed addresses only; on a GPU they are then
replayed from CUDA graphs captured at start (engine/route_graphs.py), which also make
the staging copies: one replay a step. The graphs copy the positions from the runner's
positions buffer, whose address the router learns from the start's dummy steps
(`learn_positions`) and captures them again with (`adopt_positions`); a step whose
positions are elsewhere launches its kernels instead (a warning, once)."""
from __future__ import annotations

import torch

from graphtap.engine import route_graphs
from graphtap.engine.slots import HEADER, HostRing, SlotBlock
from graphtap.log import get_logger
from graphtap.ops.tables import OpTables, RowTables

logger = get_logger(__name__)


class TokenRouter:
    """The step's token row -> (request slot, batch row) map, kept in OpTables."""

    def __init__(self, tables: OpTables, positions: bool = False, staging_depth: int = 2,
                 slots: SlotBlock | None = None):
        self.t = tables
        # the slot block whose staged writes the graphs apply first (takes_slot_writes)
        self._slots = slots if route_graphs.apply_slot_writes() else None
        self.positions = positions  # keep tok_pos (ops at slots without positions)
        self._last_layout: tuple | None = None
        self._idle = True
        self.graphs: route_graphs.RouteGraphs | None = None
        self.replays = 0  # graph replays so far (stats: proof the engine used them)
        self._graph_args: tuple | None = None  # capture_graphs' (again: adopt_positions)
        # the runner's positions buffer: learnt (dummy steps), and the one the graphs copy
        self._learnt: torch.Tensor | None = None
        self._graph_pos: torch.Tensor | None = None
        self._replaying = False  # this step replays the graphs (route_rows too)
        self._warned = False
        self._rows_done: int | None = None  # the row tables routed with this step's tokens
        self.staged = tables.backend.device_counts
        if self.staged:
            # The batch's layout at fixed addresses (route_tokens_triton): the request
            # count, query_start_loc and idx_mapping in one block, written on the host
            # from the batch's host arrays and copied in one call (three launches before),
            # then the header of the slot block's staged writes, which a replay applies
            device, slots = tables.tok_slot.device, tables.sentinel + 1
            size = 2 * slots + 2 + HEADER
            self._layout = torch.zeros(size, dtype=torch.int32, device=device)
            self._nreq, self._qsl, self._idx, self._header = \
                self._layout[:1], self._layout[1:slots + 2], \
                self._layout[slots + 2:2 * slots + 2], self._layout[2 * slots + 2:]
            self._ring = HostRing((size,), torch.int32, device, staging_depth)
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
        self._graph_args = (row_tables, max_len, capture)
        self._capture(self._learnt)

    def _capture(self, positions: torch.Tensor | None) -> None:
        row_tables, max_len, capture = self._graph_args
        rows = {id(t): (lambda n, t=t: self._launch_rows(t, n, max_len)) for t in row_tables}
        # a capture warms each body once, on what its ring buffer holds: no old writes
        # (once the device has read them: captures come at start, off the hot path)
        if self._ring.pinned:
            torch.cuda.synchronize()
        for i in range(len(self._ring)):
            self._ring.numpy(i)[-HEADER:] = 0
        stages = [self._stage_fn(self._ring.view(i), positions)
                  for i in range(len(self._ring))]
        self.graphs = None  # the old graphs go before the new are captured
        self.graphs = route_graphs.RouteGraphs.build(self.t.tok_slot.shape[0],
                                                     self._launch_tokens, rows, capture,
                                                     stages)
        self._graph_pos = positions if self.graphs is not None else None
        self.deactivate(force=True)

    def _stage_fn(self, layout: torch.Tensor, positions: torch.Tensor | None):
        """What a graph on one ring buffer does before it routes b tokens: the layout's
        copy, the positions' and the slot block's staged writes (which the row routing
        and the forward read)."""
        slots = self._slots
        if slots is not None:
            from graphtap.ops.stage_triton import apply_staged_triton

        def stage(b: int) -> None:
            self._layout.copy_(layout, non_blocking=True)
            if positions is not None:  # one device copy node
                self.t.tok_pos[:b].copy_(positions[:b], non_blocking=True)
            if slots is not None:
                apply_staged_triton(slots.gpu, self._header, slots.staging.rings(),
                                    slots.elements.rings())
        return stage

    def takes_slot_writes(self) -> bool:
        """Whether a replay applies the slot block's staged writes (so SlotBlock.apply
        may defer them; the manager flushes what no replay took, after route)."""
        return self._slots is not None and self.graphs is not None

    def learn_positions(self, positions: torch.Tensor) -> None:
        """A dummy step's positions: a view of the runner's buffer, whose whole the
        graphs may copy from (every step's positions are a prefix of it)."""
        if self._graph_args is None or self._learnt is not None:
            return
        base = positions._base if positions._base is not None else positions
        tok_pos = self.t.tok_pos
        if base.dim() == 1 and base.is_contiguous() and \
                base.data_ptr() == positions.data_ptr() and \
                base.numel() >= tok_pos.numel() and base.device == tok_pos.device:
            self._learnt = base

    def adopt_positions(self) -> None:
        """Capture the graphs again, now copying the learnt positions (at start, after
        the dummy steps: before vLLM captures its graphs, or once the KV caches exist)."""
        if self._graph_args is not None and self._learnt is not None and \
                self._graph_pos is not self._learnt and route_graphs.copy_positions():
            self._capture(self._learnt)
            if self._graph_pos is not None:
                logger.info("graphtap: routing graphs copy the runner's positions")

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
        self._replaying = self._replays(input_batch)
        positions = positions and (self.staged or self.positions)
        in_graph = self._replaying and self._graph_pos is not None
        if positions and not in_graph:
            self.t.tok_pos[:n].copy_(input_batch.positions[:n], non_blocking=True)
        layout = (tuple(input_batch.req_ids), input_batch.num_tokens, n,
                  input_batch.query_start_loc_np[: input_batch.num_reqs + 1].tobytes())
        if layout == self._last_layout and not (positions and in_graph):
            return  # same requests, same token rows: the table already says this
        num_reqs = input_batch.num_reqs
        if not self.staged:
            self.t.backend.route_tokens(self.t.tok_slot, self.t.tok_row, self.t.sentinel,
                                        input_batch.query_start_loc,
                                        input_batch.idx_mapping, n, num_reqs)
        elif self._replaying:
            # one replay: the layout's and positions' copies, the tokens (and one
            # family's rows); the same layout again routes its tokens again (microseconds
            # of the device) for the positions' copy
            stage = self._stage_layout(input_batch, num_reqs, slot_writes=True)
            if rows is not None:
                self.graphs.tokens_and_rows(id(rows), n, stage)
                self._rows_done = id(rows)
            else:
                self.graphs.tokens(n, stage)
            self.replays += 1
        else:
            self._layout.copy_(self._ring.view(self._stage_layout(input_batch, num_reqs)),
                               non_blocking=True)
            self._launch_tokens(n)
        self._last_layout = layout
        self._idle = False

    def _replays(self, input_batch) -> bool:
        """Whether this step's routing replays the graphs: not where its positions are
        not the ones the graphs copy (the kernels are launched instead)."""
        if self.graphs is None:
            return False
        if self._graph_pos is None or \
                input_batch.positions.data_ptr() == self._graph_pos.data_ptr():
            return True
        if not self._warned:
            self._warned = True
            logger.warning("graphtap: a step's positions are not in the runner's buffer the "
                           "routing graphs copy from; such steps launch the routing kernels")
        return False

    def _stage_layout(self, input_batch, num_reqs: int, slot_writes: bool = False) -> int:
        """The step's layout written into the host ring's next buffer; its index.
        `slot_writes`: a replay follows, which applies the slot block's pending writes
        (the header says there are none otherwise)."""
        i = self._ring.take_index()
        layout, slots = self._ring.numpy(i), self._idx.shape[0]
        layout[0] = num_reqs
        layout[1:num_reqs + 2] = input_batch.query_start_loc_np[:num_reqs + 1]
        layout[slots + 2:slots + 2 + num_reqs] = input_batch.idx_mapping_np[:num_reqs]
        layout[-HEADER:] = self._slots.take_pending() \
            if slot_writes and self._slots is not None else (0, 0, 0, 0)
        return i

    def route_rows(self, t: RowTables, input_batch, max_len: int) -> None:
        """A row family's units of this step (after `route`)."""
        n = input_batch.num_tokens_after_padding
        if self._replaying:
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
                "graph_replays_total": self.replays,
                # the graphs copy the runner's positions (one replay a routing step)
                "graph_positions": self._graph_pos is not None}

    def deactivate(self, force: bool = False) -> None:
        self._rows_done = None
        self._replaying = False
        if force or not self._idle:
            self.t.tok_slot.fill_(self.t.sentinel)
            self._idle = True
            self._last_layout = None

    def invalidate(self) -> None:
        """A slot's meaning changed (a new request): the next step routes again."""
        self._last_layout = None
