"""Attention-pattern capture: per-request entries, per-step route rows chosen on the
device, and the step snapshot the courier carries home.

A pattern row is one (query token, head) of one site: the op fills it with that head's
probabilities over key positions 0..position, read from the paged KV cache. Rows are
labelled on the device with (slot, site, position, head) in the route table itself, so
attribution never comes from expected lengths; the host keeps each row's causal part
(keys 0..position) as one flat ragged tensor, and the frontend unpacks it.
"""
from __future__ import annotations

import numpy as np
import torch

from graphtap.capture_scheduler import OVERFLOW_KEY
from graphtap.scheduler import position_bitmap, position_mask, wanted_in_step
from graphtap.sites import SiteTable
from graphtap.tables import PatternTables, entry_bits, host_to_device

PATTERN = "attn_pattern"
OVERFLOW_PATTERN = 1  # third field of the overflow flag: which buffer overflowed


class PatternSnapshot:
    def __init__(self, rows, route, count, slot_to_req, formats, site_names, capacity):
        self.rows, self.route, self.count = rows, route, count
        self.slot_to_req, self.formats, self.site_names = slot_to_req, formats, site_names
        self.capacity = capacity

    def to_cpu_nonblocking(self) -> None:
        self.rows = self.rows.to("cpu", non_blocking=True)
        self.route = self.route.to("cpu", non_blocking=True)
        self.count = self.count.to("cpu", non_blocking=True)

    def per_request(self) -> dict[str, dict[str, torch.Tensor]]:
        wanted = int(self.count[0])
        if wanted > self.capacity:
            flag = torch.tensor([wanted, self.capacity, OVERFLOW_PATTERN], dtype=torch.int64)
            return {req: {OVERFLOW_KEY: flag} for req in self.slot_to_req.values()}
        used = min(wanted, self.rows.shape[0])
        route = self.route[:used].numpy()  # site, token, head, batch row, position, slot
        order = np.lexsort((route[:, 2], route[:, 4], route[:, 0], route[:, 5]))
        route = route[order]
        rows = self.rows[:used][torch.from_numpy(order)]
        keys = route[:, 5] * 1_000_003 + route[:, 0]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if used else []
        out: dict[str, dict[str, torch.Tensor]] = {}
        for k, start in enumerate(starts):
            end = starts[k + 1] if k + 1 < len(starts) else used
            slot, site = int(route[start, 5]), int(route[start, 0])
            req = self.slot_to_req.get(slot)
            if req is None:
                continue
            dtype, heads = self.formats[(slot, site)]
            pos = route[start:end:heads, 4]
            width = int(pos.max()) + 1
            data = rows[start:end, :width].reshape(-1, heads, width)
            causal = torch.arange(width)[None, :] <= torch.from_numpy(pos)[:, None]
            # Ragged and flat (position, head, key <= position): the courier concatenates
            # pieces from different steps, whose widths differ (frontend: unpack_patterns).
            ragged = data[causal[:, None, :].expand_as(data)]
            name = self.site_names[site]
            out.setdefault(req, {})[name] = ragged.to(dtype, copy=True)  # see CaptureSnapshot
            out[req][f"{name}@positions"] = torch.from_numpy(pos.copy())
        return out


class PatternScheduler:
    def __init__(self, tables: PatternTables, sites: SiteTable, max_len: int,
                 model_dtype: torch.dtype, device: torch.device):
        self.t = tables
        self.sites = sites
        self.max_len = max_len
        self.model_dtype = model_dtype
        self.device = device
        self._rows_per_token: dict[str, int] = {}  # req_id -> heads summed over entries
        self._columns: dict[str, int] = {}  # req_id -> entries used (columns 0..n-1)
        self._formats: dict[int, dict[int, tuple]] = {}  # slot -> site -> (dtype, heads)
        self._slot_of: dict[str, int] = {}
        self._wanted: dict[str, np.ndarray] = {}  # req_id -> positions any entry wants
        self._step: tuple | None = None
        self._idle = True

    def add_request(self, slot: int, req_id: str, prompt_len: int, hooks: dict | None) -> None:
        self.remove_request(req_id)
        t = self.t
        c, words, num_heads = t.pat_site.shape[1], t.pat_pos.shape[2], t.pat_heads.shape[2]
        site = np.full(c, -1, np.int32)
        pos = np.zeros((c, words), np.int32)
        heads = np.zeros((c, num_heads), bool)
        formats = {}
        wanted = np.zeros(self.max_len, dtype=bool)
        entries = [e for e in (hooks or {}).get("capture", []) if e["kind"] == PATTERN]
        for i, cap in enumerate(entries):
            sid = self.sites.id_for_slot(cap["layer"], cap["kind"])
            if sid is None:
                raise RuntimeError(f"graphtap: site {cap['name']} is not configured")
            site[i] = sid
            pos[i] = position_bitmap(cap["positions"], prompt_len, self.max_len, words)
            wanted |= position_mask(cap["positions"], prompt_len, self.max_len)
            chosen = cap.get("heads") or list(range(num_heads))
            heads[i, chosen] = True
            dtype = self.model_dtype if cap["dtype"] == "model" else torch.float32
            formats[sid] = (dtype, len(chosen))
        for dst, src in ((t.pat_site, site), (t.pat_pos, pos), (t.pat_heads, heads)):
            dst[slot].copy_(host_to_device(src, self.device), non_blocking=True)
        if entries:
            self._rows_per_token[req_id] = int(heads.sum())
            self._columns[req_id] = len(entries)
            self._formats[slot] = formats
            self._slot_of[req_id] = slot
            self._wanted[req_id] = wanted

    def remove_request(self, req_id: str) -> None:
        if self._rows_per_token.pop(req_id, None) is not None:
            self._columns.pop(req_id)
            self._formats.pop(self._slot_of.pop(req_id), None)
            del self._wanted[req_id]

    def has_patterns(self, req_id: str) -> bool:
        return req_id in self._rows_per_token

    def step_requests(self, input_batch, dummy_run: bool) -> list[tuple[int, str]]:
        """(batch row, request id) of the requests that may capture patterns this step."""
        return [] if dummy_run else wanted_in_step(self._wanted, input_batch)

    def prepare_step(self, input_batch, tok_slot: torch.Tensor, tok_row: torch.Tensor,
                     dummy_run: bool, active: list[tuple[int, str]] | None = None) -> None:
        """Route rows for this step on the device; tok_slot and tok_row are routed."""
        t = self.t
        if active is None:
            active = self.step_requests(input_batch, dummy_run)
        if not active:
            if not self._idle:
                t.route[:, 0].fill_(-1)
                self._idle = True
            self._step = None
            return
        n = input_batch.num_tokens_after_padding
        slot, brow = tok_slot[:n], tok_row[:n]
        pos = input_batch.positions[:n].long().clamp(0, self.max_len - 1)
        dev = slot.device
        columns = max(self._columns[r] for _, r in active)
        site = t.pat_site[slot, :columns].T.long()  # [entries, tokens]
        on = entry_bits(t.pat_pos[:, :columns], slot, pos).T
        want = ((site >= 0) & on).unsqueeze(2) & t.pat_heads[slot, :columns].transpose(0, 1)
        num_heads = want.shape[2]
        flat = want.flatten()
        index = torch.cumsum(flat, 0) - 1
        dst = torch.where(flat & (index < t.rows), index, t.rows)
        shape = (columns, n, num_heads)
        fields = (site[:, :, None], torch.arange(n, device=dev)[None, :, None],
                  torch.arange(num_heads, device=dev)[None, None, :], brow[None, :, None],
                  pos[None, :, None], slot[None, :, None])
        route = torch.stack([f.expand(shape) for f in fields], dim=-1).reshape(-1, 6)
        t.route[:, 0].fill_(-1)
        t.route.index_copy_(0, dst, route)
        t.route[t.rows, 0] = -1  # the trash row took everything not wanted
        t.count.copy_(flat.sum().reshape(1))
        self._idle = False
        bound = sum(int(input_batch.num_scheduled_tokens[i]) * self._rows_per_token[r]
                    for i, r in active)
        self._step = ({self._slot_of[r]: r for _, r in active}, min(bound, t.rows))

    def collect(self, dummy_run: bool) -> PatternSnapshot | None:
        if dummy_run or self._step is None:
            return None
        slot_to_req, bound = self._step
        t = self.t
        formats = {(s, site): f for s in slot_to_req for site, f in self._formats[s].items()}
        names = {i: s.name for i, s in enumerate(self.sites.sites)}
        # Clones on the main stream: the next step reuses the buffer (async scheduling).
        return PatternSnapshot(t.buf[:bound].clone(), t.route[:bound].clone(),
                               t.count.clone(), slot_to_req, formats, names, t.rows)


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
