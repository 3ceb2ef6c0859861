"""Capture: rows of residual and attention sites (q, k, v, z) copied out at the positions
each request asked for, returned per request by the courier."""
from __future__ import annotations

import numpy as np
import torch

from graphtap.courier import CaptureStep, OverflowKind, RowFormat, columns
from graphtap.courier.rows import HOST_LABELS
from graphtap.engine.rows import RowFamily
from graphtap.ops.tables import Label
from graphtap.spec.entries import NormalisedSpec


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
        self._sunk: dict[int, frozenset[int]] = {}  # slot -> its sites' ids sent to the sink
        self._input_ids: torch.Tensor | None = None  # the routed step's, while it sinks

    def entries(self, spec: NormalisedSpec) -> tuple:
        return spec.capture

    def kind_of(self, entry) -> str:
        return entry.kind

    def describe(self, entry, dtype: torch.dtype) -> tuple[RowFormat, int]:
        width, head_dim = self.widths[entry.kind]
        return RowFormat(dtype, width, entry.heads, head_dim), 1  # one row per token

    def add_request(self, slot: int, req_id: str, prompt_len: int,
                    spec: NormalisedSpec) -> None:
        self._sunk.pop(slot, None)
        super().add_request(slot, req_id, prompt_len, spec)
        if spec.capture:
            self._cols[slot] = max(map(columns, self._formats[slot].values()))
        sunk = frozenset(self.sites.id_of(e.layer, e.kind) for e in spec.capture if e.sink)
        if sunk and self.sink is not None and req_id in self._slot_of:
            self._sunk[slot] = sunk

    def remove_request(self, req_id: str) -> None:
        slot = self._slot_of.get(req_id)
        super().remove_request(req_id)
        if slot is not None and self._sunk.pop(slot, None) is not None and not self._sunk:
            self.sink.flush()  # the last sink request left: its partial shards go out

    def route(self, input_batch, router, plan) -> None:
        super().route(input_batch, router, plan)
        self._input_ids = input_batch.input_ids if self._sunk else None

    def deactivate(self) -> None:
        super().deactivate()
        self._input_ids = None

    def snapshot(self):
        step = super().snapshot()
        if step is not None and self._sunk:
            pairs = {(s, site) for s in step.slot_to_req for site in self._sunk.get(s, ())}
            if pairs:
                step.sink = SinkTap(self.sink, pairs, self._sunk)
                # each row's input token id, gathered on the device by its TOKEN label
                # (copied home with the rows): decode tokens exist nowhere else here
                ids, n = self._input_ids, len(step.rows)
                tok = self.t.labels[:n, Label.TOKEN].clamp(0, len(ids) - 1)
                step.tokens = ids[tok].to(torch.int64)
        return step


class SinkTap:
    """What a capture step sends to the sink: the (slot, site) pairs whose rows go there
    instead of into their request's output."""

    def __init__(self, writer, pairs: set[tuple[int, int]], live: dict):
        self.writer, self.pairs, self._live = writer, pairs, live

    def put(self, site: str, runs: list[tuple[str, int]], positions: np.ndarray,
            rows: torch.Tensor, tokens: np.ndarray) -> None:
        """`runs`: (request id, rows) in the order of `positions`, `rows` and `tokens`."""
        index = self.writer.request_index
        request = np.repeat([index(r) for r, _ in runs], [n for _, n in runs])
        self.writer.put(site, request, positions, rows, tokens)  # it takes int64 of them

    def done(self) -> None:
        """After the step's puts: with no sink request left (the last finished before
        its rows came home) the partial shards go out now."""
        if not self._live:
            self.writer.flush()

    def columns(self, slots, hi: int) -> int:
        # A row spans the widest configured site (Qwen2-1.5B: 1536 columns) where k rows
        # of 2 chosen heads read 256: copying whole rows home moved 6x the bytes of a qk
        # prefill step. Every request of the batch with entries counts, wanting rows now
        # or not, as in the step's attribution (RowFamily.route).
        return max((self._cols[s] for s in slots), default=0)
