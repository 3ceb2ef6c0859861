"""Capture: per-request entries and the per-step buffer rows chosen on the device; the
step's snapshot goes home through the courier (courier.py).

Every captured row is labelled on the device with (request slot, site, position) as it is
written; the host maps slots to request ids with the step's own batch, so attribution
never comes from expected lengths (EasySteer's bug). Position rules are evaluated from
each token's actual position, so chunked prefill and recomputation after preemption
capture what really ran; the frontend orders rows by position and keeps the last row per
position.
"""
from __future__ import annotations

import numpy as np
import torch

from graphtap.courier import CaptureSnapshot, columns
from graphtap.ops.route import route_captures
from graphtap.scheduler import Wants, position_bitmap, positions_end, rows_in_step
from graphtap.sites import SiteTable
from graphtap.tables import CaptureTables, host_to_device


class RequestEntries:
    """Per-request bookkeeping shared by row captures and attention patterns: the slot a
    request holds, its output format per site, the positions any of its entries wants
    (for the host-side step skip and row bound), and the current step's snapshot bounds."""

    def __init__(self, tables, sites: SiteTable, max_len: int, model_dtype: torch.dtype,
                 device: torch.device):
        self.t = tables
        self.sites = sites
        self.max_len = max_len
        self.model_dtype = model_dtype
        self.device = device
        self._formats: dict[int, dict[int, tuple]] = {}  # slot -> site -> output format
        self._cols: dict[int, int] = {}  # slot -> buffer columns its formats read
        self._slot_of: dict[str, int] = {}
        self._wanted: dict[str, Wants] = {}  # req_id -> positions its entries want
        # slot -> past its last wanted position, 0 without entries (rows_in_step's
        # one-pass prefilter); sized by the first request's table
        self._ends: np.ndarray | None = None
        # (slot -> req_id, row bound, positions end) of the current step
        self._step: tuple | None = None
        self._idle = True

    def _entry(self, cap: dict, prompt_len: int, words: int):
        """One capture entry -> (site id, position bitmap, output dtype)."""
        sid = self.sites.id_for_slot(cap["layer"], cap["kind"])
        if sid is None:  # the frontend checks this; a mismatch must not go unnoticed
            raise RuntimeError(f"graphtap: site {cap['name']} is not configured")
        rule = cap["positions"]
        dtype = self.model_dtype if cap["dtype"] == "model" else torch.float32
        return sid, position_bitmap(rule, prompt_len, self.max_len, words), dtype

    def _add(self, slot: int, req_id: str, prompt_len: int, entries: list[dict],
             site_table: torch.Tensor, pos_table: torch.Tensor, describe) -> None:
        """Write a request's entries into its slot's rows of the site and position tables
        (every column, so a reused slot inherits nothing) and keep its bookkeeping.
        describe(i, entry, dtype) -> (output format, rows per wanted token)."""
        self.remove_request(req_id)
        c, words = site_table.shape[1], pos_table.shape[2]
        site = np.full(c, -1, np.int32)
        pos = np.zeros((c, words), np.int32)
        formats, wanted = {}, Wants(self.max_len)
        for i, cap in enumerate(entries):
            site[i], pos[i], dtype = self._entry(cap, prompt_len, words)
            formats[int(site[i])], rows_per_token = describe(i, cap, dtype)
            wanted.add(cap["positions"], prompt_len, rows_per_token)
        for dst, src in ((site_table, site), (pos_table, pos)):
            dst[slot].copy_(host_to_device(src, self.device), non_blocking=True)
        if self._ends is None:
            self._ends = np.zeros(site_table.shape[0], np.int64)
        self._ends[slot] = wanted.end if entries else 0
        if entries:
            self._formats[slot] = formats
            self._slot_of[req_id] = slot
            self._wanted[req_id] = wanted

    def remove_request(self, req_id: str) -> None:
        if req_id in self._slot_of:
            slot = self._slot_of.pop(req_id)
            self._formats.pop(slot, None)
            self._cols.pop(slot, None)
            self._ends[slot] = 0
            del self._wanted[req_id]

    def holds(self, req_id: str) -> bool:
        """Whether the request has entries here."""
        return req_id in self._slot_of

    def step_requests(self, input_batch, dummy_run: bool) -> list[tuple[int, str, int]]:
        """(batch row, request id, row bound) of the requests that may capture in this
        step (scheduler.rows_in_step)."""
        return [] if dummy_run else rows_in_step(self._wanted, input_batch, self._ends)

    def _in_batch(self, input_batch) -> list[str]:
        """Every request of the batch with entries here, capturing this step or not."""
        return [r for r in input_batch.req_ids if r in self._slot_of]

    def _set_step(self, input_batch, active: list[tuple[int, str, int]]) -> None:
        bound = min(sum(rows for _, _, rows in active), self.t.rows)
        # Rows are attributed (and overflow reported) for every request of the batch
        # with entries, not only those the host expects to capture now: the device
        # routes them all, so a wrong host window can cost a step's bound (reported as
        # a graphtap bug) but never drop a live request's rows silently.
        self._step = ({self._slot_of[r]: r for r in self._in_batch(input_batch)}, bound,
                      positions_end(input_batch, self.max_len))

    def _columns(self, slots, hi: int) -> int | None:
        """Buffer columns the step's rows can use (slots: the batch's requests with
        entries; hi: past the step's last position); None: all."""
        return None

    def _snapshot(self, cls, rows: torch.Tensor, labels: torch.Tensor, dummy_run: bool):
        """Clone the step's used rows, and of them the columns its requests can use
        (_columns): the clone, the copy home and its pinned buffer shrink with them."""
        if dummy_run or self._step is None:
            return None
        slot_to_req, bound, hi = self._step
        rows = rows[:bound, :self._columns(slot_to_req, hi)]
        formats = {(s, site): f for s in slot_to_req for site, f in self._formats[s].items()}
        names = {i: s.name for i, s in enumerate(self.sites.sites)}
        # Clones on the main stream: the next step reuses the buffer (async scheduling).
        return cls(rows.clone(), labels[:bound].clone(), self.t.count.clone(),
                   slot_to_req, formats, names, self.t.rows)


class CaptureScheduler(RequestEntries):
    def __init__(self, tables: CaptureTables, sites: SiteTable, max_len: int,
                 model_dtype: torch.dtype, device: torch.device, widths: dict[str, tuple]):
        super().__init__(tables, sites, max_len, model_dtype, device)
        self.widths = widths  # kind -> (row width, head_dim or 0)
        if device.type == "cuda":
            # Compile the routing kernels now, not in the first capturing step: one token
            # of the sentinel slot wants nothing, so the tables stay as they are.
            sentinel = torch.full((1,), tables.cap_site.shape[0] - 1, device=device)
            route_captures(tables, sentinel, torch.zeros_like(sentinel), max_len)

    def add_request(self, slot: int, req_id: str, prompt_len: int, hooks: dict | None) -> None:
        # Attention patterns have their own tables (pattern_scheduler.py).
        entries = [e for e in (hooks or {}).get("capture", []) if e["kind"] != "attn_pattern"]

        def describe(i: int, cap: dict, dtype: torch.dtype):  # one row per wanted token
            width, head_dim = self.widths[cap["kind"]]
            heads = cap.get("heads")  # a tuple: formats key the step split's copies
            return (dtype, width, None if heads is None else tuple(heads), head_dim), 1

        self._add(slot, req_id, prompt_len, entries, self.t.cap_site, self.t.cap_pos, describe)
        if entries:
            self._cols[slot] = max(map(columns, self._formats[slot].values()))

    def _columns(self, slots, hi: int) -> int:
        # A row spans the widest configured site (Qwen2-1.5B: 1536 columns) where k rows
        # of 2 chosen heads read 256: copying whole rows home moved 6x the bytes of a qk
        # prefill step. Every request of the batch with entries counts, capturing now or
        # not, as in the step's attribution (_set_step).
        return max((self._cols[s] for s in slots), default=0)

    def prepare_step(self, input_batch, tok_slot: torch.Tensor, dummy_run: bool,
                     capturing: list[tuple[int, str, int]] | None = None) -> None:
        """Choose buffer rows for this step, on the device. tok_slot is already routed."""
        t = self.t
        if capturing is None:
            capturing = self.step_requests(input_batch, dummy_run)
        if not capturing:
            if not self._idle:
                t.cap_dst.fill_(t.rows)
                self._idle = True
            self._step = None
            return
        n = input_batch.num_tokens_after_padding
        route_captures(t, tok_slot[:n], input_batch.positions[:n], self.max_len)
        self._idle = False
        self._set_step(input_batch, capturing)  # host-side bound on the rows used: no sync

    def collect(self, input_batch, dummy_run: bool) -> CaptureSnapshot | None:
        return self._snapshot(CaptureSnapshot, self.t.buf, self.t.meta, dummy_run)
