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

from graphtap.capture_scheduler import RequestEntries
from graphtap.courier import LabelledSnapshot
from graphtap.sites import SiteTable
from graphtap.tables import PatternTables, entry_bits, host_to_device

PATTERN = "attn_pattern"


class PatternSnapshot(LabelledSnapshot):
    """Labels: the route rows (site, token, head, batch row, position, slot)."""

    OVERFLOW_KIND = 1

    def per_request(self) -> dict[str, dict[str, torch.Tensor]]:
        lost = self.overflow()
        if lost is not None:
            return lost
        out: dict[str, dict[str, torch.Tensor]] = {}
        for req, slot, site, labels, rows in self.groups((5, 0, 4, 2), 5, 0):
            dtype, heads = self.formats[(slot, site)]
            pos = labels[::heads, 4]
            width = int(pos.max()) + 1
            data = rows[:, :width].reshape(-1, heads, width)
            causal = torch.arange(width)[None, :] <= torch.from_numpy(pos)[:, None]
            # Ragged and flat (position, head, key <= position): the courier concatenates
            # pieces from different steps, whose widths differ (frontend: unpack_patterns).
            ragged = data[causal[:, None, :].expand_as(data)]
            name = self.site_names[site]
            # Boolean indexing copied already: nothing here views the pinned step buffer.
            out.setdefault(req, {})[name] = ragged.to(dtype)
            out[req][f"{name}@positions"] = torch.from_numpy(pos.copy())
        return out


class PatternScheduler(RequestEntries):
    """Output format per site: (dtype, number of heads)."""

    def __init__(self, tables: PatternTables, sites: SiteTable, max_len: int,
                 model_dtype: torch.dtype, device: torch.device):
        super().__init__(tables, sites, max_len, model_dtype, device)

    def add_request(self, slot: int, req_id: str, prompt_len: int, hooks: dict | None) -> None:
        t = self.t
        heads = np.zeros((t.pat_heads.shape[1], t.pat_heads.shape[2]), bool)
        entries = [e for e in (hooks or {}).get("capture", []) if e["kind"] == PATTERN]

        def describe(i: int, cap: dict, dtype: torch.dtype):  # one row per chosen head
            chosen = cap.get("heads") or list(range(heads.shape[1]))
            heads[i, chosen] = True
            return (dtype, len(chosen)), len(chosen)

        self._add(slot, req_id, prompt_len, entries, t.pat_site, t.pat_pos, describe)
        t.pat_heads[slot].copy_(host_to_device(heads, self.device), non_blocking=True)

    def prepare_step(self, input_batch, tok_slot: torch.Tensor, tok_row: torch.Tensor,
                     dummy_run: bool, active: list[tuple[int, str, int]] | None = None
                     ) -> None:
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
        # Entries fill columns 0..n-1, one format each (a request captures a site once).
        columns = max(len(self._formats[self._slot_of[r]]) for r in self._in_batch(input_batch))
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
        self._set_step(input_batch, active)

    def _columns(self, slots, hi: int) -> int:
        return hi  # a pattern row spans max_model_len keys; no step reaches past hi

    def collect(self, dummy_run: bool) -> PatternSnapshot | None:
        return self._snapshot(PatternSnapshot, self.t.buf, self.t.route, dummy_run)


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
