"""Capture: per-request entries, per-step buffer rows chosen on the device, and the step
snapshot the courier carries home.

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

from graphtap.scheduler import position_bitmap, position_mask, wanted_in_step
from graphtap.sites import SiteTable
from graphtap.tables import CaptureTables, entry_bits, host_to_device

OVERFLOW_KEY = "graphtap:overflow"  # value: [rows wanted, capacity, 0 rows | 1 patterns]


class StepSnapshots:
    """The snapshots of one step (rows, patterns), handed to the courier as one."""

    def __init__(self, parts):
        self.parts = parts

    def to_cpu_nonblocking(self) -> None:
        for part in self.parts:
            part.to_cpu_nonblocking()

    def per_request(self) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        for part in self.parts:
            for req, tensors in part.per_request().items():
                out.setdefault(req, {}).update(tensors)
        return out


class LabelledSnapshot:
    """One step's labelled device rows (captures or patterns): cloned on the main stream,
    copied to the host on the output copy stream, split per request once the copy is
    done (HookManager.collect). Subclasses say how labels sort and what a group becomes."""

    OVERFLOW_KIND = 0  # third field of the overflow flag: 0 capture rows, 1 pattern rows

    def __init__(self, rows, labels, count, slot_to_req, formats, site_names, capacity):
        self.rows, self.labels, self.count = rows, labels, count
        self.slot_to_req, self.formats, self.site_names = slot_to_req, formats, site_names
        self.capacity = capacity

    def to_cpu_nonblocking(self) -> None:
        self.rows = self.rows.to("cpu", non_blocking=True)
        self.labels = self.labels.to("cpu", non_blocking=True)
        self.count = self.count.to("cpu", non_blocking=True)

    def overflow(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """Rows were lost: say so for every capturing request (never a partial result)."""
        wanted = int(self.count[0])
        if wanted <= self.capacity:
            return None
        flag = torch.tensor([wanted, self.capacity, self.OVERFLOW_KIND], dtype=torch.int64)
        return {req: {OVERFLOW_KEY: flag} for req in self.slot_to_req.values()}

    def groups(self, order: tuple[int, ...], slot_col: int, site_col: int):
        """Rows sorted by the label columns `order` (most significant first), as
        (request id, slot, site, labels, rows) per (slot, site) of a live request."""
        used = min(int(self.count[0]), self.rows.shape[0])
        labels = self.labels[:used].numpy()
        perm = np.lexsort(tuple(labels[:, c] for c in reversed(order)))
        labels, rows = labels[perm], self.rows[:used][torch.from_numpy(perm)]
        keys = labels[:, slot_col] * 1_000_003 + labels[:, site_col]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if used else []
        for start, end in zip(starts, [*starts[1:], used]):
            slot, site = int(labels[start, slot_col]), int(labels[start, site_col])
            req = self.slot_to_req.get(slot)
            if req is not None:
                yield req, slot, site, labels[start:end], rows[start:end]


class CaptureSnapshot(LabelledSnapshot):
    """Labels: (slot, site, position) per row."""

    def per_request(self) -> dict[str, dict[str, torch.Tensor]]:
        lost = self.overflow()
        if lost is not None:
            return lost
        out: dict[str, dict[str, torch.Tensor]] = {}
        for req, slot, site, labels, rows in self.groups((0, 1, 2), 0, 1):
            name = self.site_names[site]
            dtype, width, heads, head_dim = self.formats[(slot, site)]
            data = rows[:, :width]
            if head_dim:  # attention sites: [rows, heads, head_dim], chosen heads only
                data = data.reshape(len(labels), -1, head_dim)
                data = data[:, heads] if heads is not None else data
            # A copy: a view would pin the step's whole host buffer (pinned memory, from
            # the caching host allocator) until the request finishes.
            out.setdefault(req, {})[name] = data.to(dtype, copy=True,
                                                    memory_format=torch.contiguous_format)
            out[req][f"{name}@positions"] = torch.from_numpy(labels[:, 2].copy())
        return out


class RequestEntries:
    """Per-request bookkeeping shared by row captures and attention patterns: the slot a
    request holds, its output format per site, the positions any of its entries wants
    (for the host-side step skip), and the current step's (slot -> request, row bound)."""

    def __init__(self, tables, sites: SiteTable, max_len: int, model_dtype: torch.dtype,
                 device: torch.device):
        self.t = tables
        self.sites = sites
        self.max_len = max_len
        self.model_dtype = model_dtype
        self.device = device
        self._formats: dict[int, dict[int, tuple]] = {}  # slot -> site -> output format
        self._slot_of: dict[str, int] = {}
        self._wanted: dict[str, np.ndarray] = {}  # req_id -> positions any entry wants
        self._step: tuple | None = None  # (slot -> req_id, row bound) of the current step
        self._idle = True

    def _entry(self, cap: dict, prompt_len: int, words: int):
        """One capture entry -> (site id, position bitmap, position mask, output dtype)."""
        sid = self.sites.id_for_slot(cap["layer"], cap["kind"])
        if sid is None:  # the frontend checks this; a mismatch must not go unnoticed
            raise RuntimeError(f"graphtap: site {cap['name']} is not configured")
        rule = cap["positions"]
        dtype = self.model_dtype if cap["dtype"] == "model" else torch.float32
        return (sid, position_bitmap(rule, prompt_len, self.max_len, words),
                position_mask(rule, prompt_len, self.max_len), dtype)

    def _keep(self, req_id: str, slot: int, formats: dict, wanted: np.ndarray) -> None:
        self._formats[slot] = formats
        self._slot_of[req_id] = slot
        self._wanted[req_id] = wanted

    def _forget(self, req_id: str) -> None:
        self._formats.pop(self._slot_of.pop(req_id), None)
        del self._wanted[req_id]

    def step_requests(self, input_batch, dummy_run: bool) -> list[tuple[int, str]]:
        """(batch row, request id) of the requests that may capture in this step."""
        return [] if dummy_run else wanted_in_step(self._wanted, input_batch)

    def _snapshot(self, cls, rows: torch.Tensor, labels: torch.Tensor, dummy_run: bool):
        if dummy_run or self._step is None:
            return None
        slot_to_req, bound = self._step
        formats = {(s, site): f for s in slot_to_req for site, f in self._formats[s].items()}
        names = {i: s.name for i, s in enumerate(self.sites.sites)}
        # Clones on the main stream: the next step reuses the buffer (async scheduling).
        return cls(rows[:bound].clone(), labels[:bound].clone(), self.t.count.clone(),
                   slot_to_req, formats, names, self.t.rows)


class CaptureScheduler(RequestEntries):
    def __init__(self, tables: CaptureTables, sites: SiteTable, max_len: int,
                 model_dtype: torch.dtype, device: torch.device, widths: dict[str, tuple]):
        super().__init__(tables, sites, max_len, model_dtype, device)
        self.widths = widths  # kind -> (row width, head_dim or 0)
        self._entries: dict[str, int] = {}  # req_id -> number of capture entries

    def add_request(self, slot: int, req_id: str, prompt_len: int, hooks: dict | None) -> None:
        self.remove_request(req_id)
        c, words = self.t.cap_site.shape[1], self.t.cap_pos.shape[2]
        site = np.full(c, -1, np.int32)
        pos = np.zeros((c, words), np.int32)
        formats = {}
        wanted = np.zeros(self.max_len, dtype=bool)
        # Attention patterns have their own tables (pattern_scheduler.py).
        entries = [e for e in (hooks or {}).get("capture", []) if e["kind"] != "attn_pattern"]
        for i, cap in enumerate(entries):
            site[i], pos[i], mask, dtype = self._entry(cap, prompt_len, words)
            wanted |= mask
            width, head_dim = self.widths[cap["kind"]]
            formats[int(site[i])] = (dtype, width, cap.get("heads"), head_dim)
        self.t.cap_site[slot].copy_(host_to_device(site, self.device), non_blocking=True)
        self.t.cap_pos[slot].copy_(host_to_device(pos, self.device), non_blocking=True)
        if entries:
            self._entries[req_id] = len(entries)
            self._keep(req_id, slot, formats, wanted)

    def remove_request(self, req_id: str) -> None:
        if self._entries.pop(req_id, None) is not None:
            self._forget(req_id)

    def has_captures(self, req_id: str) -> bool:
        return req_id in self._entries

    def prepare_step(self, input_batch, tok_slot: torch.Tensor, dummy_run: bool,
                     capturing: list[tuple[int, str]] | None = None) -> None:
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
        num_sites = t.cap_dst.shape[0]
        slot = tok_slot[:n]
        pos = input_batch.positions[:n].long().clamp(0, self.max_len - 1)
        tokens = torch.arange(n, device=slot.device)
        # All entries at once: a fixed number of kernels per step, whatever max_captures.
        # A request names each site once, so active (site, token) pairs never collide and
        # a plain index_put_ suffices; inactive entries write into an extra, dropped row.
        # (accumulate=True would take CUDA's sort-based path every step.)
        site = t.cap_site[slot].long()  # [n, C]
        on = (site >= 0) & entry_bits(t.cap_pos, slot, pos)
        want = torch.zeros((num_sites + 1, n), dtype=torch.bool, device=slot.device)
        want.index_put_((torch.where(on, site, num_sites), tokens[:, None].expand_as(site)), on)
        flat = want[:num_sites].flatten()
        index = torch.cumsum(flat, 0) - 1
        dst = torch.where(flat & (index < t.rows), index, t.rows)
        t.cap_dst[:, :n].copy_(dst.view(num_sites, n))
        t.count.copy_(flat.sum().reshape(1))
        sites = torch.arange(num_sites, device=slot.device).repeat_interleave(n)
        labels = torch.stack((slot.repeat(num_sites), sites, pos.repeat(num_sites)), dim=1)
        t.meta[:, 0].fill_(-1)
        t.meta.index_copy_(0, dst, labels)
        self._idle = False
        # Host-side bound on rows used (no sync): every scheduled token at every entry.
        bound = sum(int(input_batch.num_scheduled_tokens[i]) * self._entries[r]
                    for i, r in capturing)
        slot_to_req = {self._slot_of[r]: r for _, r in capturing}
        self._step = (slot_to_req, min(bound, t.rows))

    def collect(self, input_batch, dummy_run: bool) -> CaptureSnapshot | None:
        return self._snapshot(CaptureSnapshot, self.t.buf, self.t.meta, dummy_run)
