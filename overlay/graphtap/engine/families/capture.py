"""Capture: rows of residual and attention sites (q, k, v, z) copied out at the positions
each request asked for, returned per request by the courier."""
from __future__ import annotations

import numpy as np
import torch

from graphtap.courier import CaptureStep, OverflowKind, RowFormat, columns
from graphtap.courier.rows import HOST_LABELS, NO_SINK
from graphtap.engine.rows import EntryPlan, RowFamily
from graphtap.ops.tables import Label
from graphtap.spec.entries import NormalisedSpec
from graphtap.spec.sites import RESID_KINDS


class CaptureFamily(RowFamily):
    """Row captures of residual and attention sites; one buffer row per wanted token."""

    name = "capture"
    step_class = CaptureStep
    overflow_kind = OverflowKind.CAPTURE_ROWS
    host_labels = HOST_LABELS

    def __init__(self, *args, widths: dict[str, tuple[int, int]], sink=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.widths = widths  # kind -> (row width, head_dim or 0)
        self.sink = sink  # courier.sink.SinkWriter of the engine (hook_config.sink_dir)
        # Which rows go to the sink, as arrays the courier indexes with a step's labels
        # (a decode step of 64 requests x 32 sites is 2048 one-row groups: looked at one
        # by one they cost more than the step): per (slot, site) the sink format's id
        # (NO_SINK: the rows come back with the request), per slot its request's index
        # in the sink.
        slots = self.slots.host.shape[0]
        self._sink_format = np.full((slots, len(self.sites)), NO_SINK, np.int32)
        self._sink_request = np.zeros(slots, np.int64)
        self._sink_whole = np.zeros(slots, bool)  # every capture entry of the slot sinks
        self._sink_formats: dict[RowFormat, int] = {}
        self._sunk: set[int] = set()  # slots of live requests with sink entries
        self._heads: set[int] = set()  # slots of live requests capturing attention sites
        self._input_ids: torch.Tensor | None = None  # the routed step's, while it sinks
        # the sink steps' rows go home on a stream of their own (CaptureStep._rows_home)
        self._sink_stream = torch.cuda.Stream(self.t.buf.device) \
            if sink is not None and self.t.buf.is_cuda else None

    def entries(self, spec: NormalisedSpec) -> tuple:
        return spec.capture

    def kind_of(self, entry) -> str:
        return entry.kind

    def describe(self, entry, dtype: torch.dtype) -> tuple[RowFormat, int]:
        width, head_dim = self.widths[entry.kind]
        return RowFormat(dtype, width, entry.heads, head_dim), 1  # one row per token

    def columns(self, slots, batch) -> int:
        # A row spans the widest configured site (Qwen2-1.5B: 1536 columns) where k rows
        # of 2 chosen heads read 256: copying whole rows home moved 6x the bytes of a qk
        # prefill step. Every request of the batch with entries counts, wanting rows now
        # or not, as in the step's attribution (RowFamily.route).
        return max((self._cols[s] for s in slots), default=0)

    def split_rows(self, slots) -> bool:
        # residual rows are whole on every rank: only steps with heads are summed
        return not self._heads.isdisjoint(slots)

    def add_request(self, slot: int, req_id: str, prompt_len: int,
                    spec: NormalisedSpec) -> EntryPlan | None:
        self._clear_slot(slot)
        plan = super().add_request(slot, req_id, prompt_len, spec)
        if plan is None:
            return None
        memo = plan.memo  # per distinct entries, as the plan (a burst asks the same)
        if not memo:
            memo["cols"] = max(map(columns, plan.formats.values()))
            memo["heads"] = any(e.kind not in RESID_KINDS for e in spec.capture)
        self._cols[slot] = memo["cols"]
        if memo["heads"]:
            self._heads.add(slot)
        if self.sink is None:
            return plan
        for e in spec.capture:
            if e.sink:
                site = self.sites.id_of(e.layer, e.kind)
                fmt = self._formats[slot][site]
                self._sink_format[slot, site] = self._sink_formats.setdefault(
                    fmt, len(self._sink_formats))
                self._sunk.add(slot)
        if slot in self._sunk:
            self._sink_request[slot] = self.sink.request_index(req_id)
            self._sink_whole[slot] = all(e.sink for e in spec.capture)
        return plan

    def remove_request(self, req_id: str) -> None:
        slot = self._slot_of.get(req_id)
        super().remove_request(req_id)
        if slot is not None and self._clear_slot(slot) and not self._sunk:
            self.sink.flush()  # the last sink request left: its partial shards go out

    def _clear_slot(self, slot: int) -> bool:
        """Clears the slot's marks (heads, sink formats); whether it had sink entries."""
        self._heads.discard(slot)
        self._sink_format[slot] = NO_SINK
        self._sink_whole[slot] = False
        if slot not in self._sunk:
            return False
        self._sunk.discard(slot)
        return True

    def copies_home(self, slots) -> bool:
        return self._sunk.isdisjoint(slots)  # sink rows go home on the sink's stream

    def route(self, input_batch, router, plan) -> None:
        super().route(input_batch, router, plan)
        self._input_ids = input_batch.input_ids if self._sunk else None

    def deactivate(self) -> None:
        super().deactivate()
        self._input_ids = None

    def snapshot(self):
        step = super().snapshot()
        if step is not None and not self._sunk.isdisjoint(step.slot_to_req):
            # copies: the tables change with the next step's requests before the courier
            # reads this step's rows
            step.sink = SinkTap(self.sink, self._sink_format.copy(),
                                self._sink_request.copy(), tuple(self._sink_formats),
                                self._sunk, self._sink_stream,  # a format's id: its place
                                self._sink_whole.copy())
            # each row's input token id, gathered on the device by its TOKEN label
            # (copied home with the rows): decode tokens exist nowhere else here
            ids, n = self._input_ids, len(step.rows)
            tok = self.t.labels[:n, Label.TOKEN].clamp(0, len(ids) - 1)
            step.tokens = ids[tok].to(torch.int64)
        return step


class SinkTap:
    """What a capture step sends to the sink: per (slot, site) the sink format's id in
    `formats` (NO_SINK: the rows go back with their request instead), per slot the
    request's index in the sink, and whether every capture entry of it sinks (`whole`;
    None: not known, the courier decides row by row)."""

    def __init__(self, writer, format_of: np.ndarray, request_of: np.ndarray,
                 formats: tuple[RowFormat, ...], live: set, stream=None,
                 whole: np.ndarray | None = None):
        self.writer, self.format_of, self.request_of = writer, format_of, request_of
        self.formats, self._live, self.whole = formats, live, whole
        self.stream = stream  # the sink rows' copy stream (None: vLLM's, on CPU)

    def done(self) -> None:
        """After the step's puts: with no sink request left (the last finished before
        its rows came home) the partial shards go out now."""
        if not self._live:
            self.writer.flush()
