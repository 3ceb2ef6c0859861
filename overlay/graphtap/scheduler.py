"""Per-request entries and per-step token routing for the steering tables.

add_request writes a request slot's whole row (every field, so a reused slot never
inherits anything); prepare_step maps each token row of the batch to its request slot on
the device, from the batch layout, without a host sync. Position rules are evaluated in
the op from the token's actual position, so chunked prefill, preemption and spec decode
need nothing here.
"""
from __future__ import annotations

import numpy as np
import torch

from graphtap.ops.route import route_tokens
from graphtap.sites import SiteTable
from graphtap.tables import SteerTables, host_to_device
from graphtap.vectors import VectorBank


def position_mask(rule, prompt_len: int, max_len: int, size: int | None = None) -> np.ndarray:
    """A position rule as a bool array over positions 0..size-1 (default max_len)."""
    mask = np.zeros(size or max_len, dtype=bool)
    if rule == "all":
        mask[:max_len] = True
    elif rule == "prompt":
        mask[:prompt_len] = True
    elif rule == "generated":
        mask[prompt_len:max_len] = True
    elif rule == "last_prompt":
        mask[max(prompt_len - 1, 0)] = True
    elif isinstance(rule, dict):
        mask[rule["start"]:rule["end"]] = True
    else:
        mask[np.asarray(rule, dtype=np.int64)] = True
    return mask


def position_bitmap(rule, prompt_len: int, max_len: int, words: int) -> np.ndarray:
    mask = position_mask(rule, prompt_len, max_len, words * 32)
    # Bit j of word w is position 32*w + j, as the op reads it.
    bits = mask.reshape(words, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    return bits.sum(axis=1).astype(np.uint32).view(np.int32)


class Wants:
    """A request's wanted positions, one bool mask per distinct position rule, each with
    the rows a wanted token yields (entries using the rule; heads, for patterns)."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self._by_rule: dict[str, list] = {}  # repr(rule) -> [mask, rows per token]
        self.end = 0  # past the last wanted position: decoding past a probe costs nothing

    def add(self, rule, prompt_len: int, rows_per_token: int) -> None:
        key = repr(rule)
        if key not in self._by_rule:
            mask = position_mask(rule, prompt_len, self.max_len)
            self._by_rule[key] = [mask, 0]
            wanted = np.flatnonzero(mask)
            self.end = max(self.end, int(wanted[-1]) + 1 if wanted.size else 0)
        self._by_rule[key][1] += rows_per_token

    def rows_in(self, lo: int, hi: int, tokens: int) -> int:
        """Upper bound on rows from `tokens` tokens at positions within [lo, hi)."""
        if lo >= self.end:
            return 0
        return sum(per * min(tokens, int(np.count_nonzero(mask[lo:hi])))
                   for mask, per in self._by_rule.values())


def rows_in_step(wants: dict[str, Wants], input_batch,
                 ends: np.ndarray | None = None) -> list[tuple[int, str, int]]:
    """(batch row, request id, bound on its rows) of the requests whose wanted positions
    may fall in this step's tokens. Host-side, so it may err towards routing: with
    speculative decoding the host's computed-token count can run ahead by the rejected
    drafts, and the window widens by them. Requests that want
    nothing now (a last_prompt capture while decoding) then cost nothing on the device,
    and the bound sizes the step's copy to the host (a last_prompt probe's prefill
    copies one row per entry, not one per prompt token).

    `ends` (slot -> Wants.end, 0 for a slot without entries) lets one numpy pass drop
    the batch rows whose window starts past everything they want: every row of a decode
    step of last-prompt probes, which otherwise cost a Python iteration each (~0.5 us
    here, 64 rows per step at 64 requests; more on the H200's host) on each step's
    critical path."""
    computed = getattr(input_batch, "num_computed_tokens_np", None)
    drafts = getattr(input_batch, "num_draft_tokens_per_req", None)
    req_ids = input_batch.req_ids
    rows = range(len(req_ids))
    slots = getattr(input_batch, "idx_mapping_np", None)
    if ends is not None and computed is not None and slots is not None:
        n = len(req_ids)
        lo = computed[:n].astype(np.int64)
        if drafts is not None:
            lo -= drafts[:n]
        rows = np.flatnonzero(np.maximum(lo, 0) < ends[slots[:n]]).tolist()
    out = []
    for i in rows:
        r = req_ids[i]
        want = wants.get(r)
        if want is None:
            continue
        tokens = int(input_batch.num_scheduled_tokens[i])
        if computed is None:  # no host view of positions: every token may capture
            out.append((i, r, want.rows_in(0, want.max_len, tokens)))
            continue
        slack = int(drafts[i]) if drafts is not None else 0
        lo = max(int(computed[i]) - slack, 0)
        hi = min(int(computed[i]) + tokens, want.max_len)
        rows = want.rows_in(lo, hi, tokens)
        if rows:
            out.append((i, r, rows))
    return out


def positions_end(input_batch, max_len: int) -> int:
    """A host-side bound on every position in the batch, plus one (no sync)."""
    computed = getattr(input_batch, "num_computed_tokens_np", None)
    if computed is None or not input_batch.num_reqs:
        return max_len
    n = input_batch.num_reqs
    ends = computed[:n].astype(np.int64) + input_batch.num_scheduled_tokens[:n]
    return min(int(ends.max()), max_len)


class SteerScheduler:
    def __init__(self, tables: SteerTables, sites: SiteTable, device: torch.device):
        self.t = tables
        self.sites = sites
        self.device = device
        self.bank = VectorBank(tables)
        self._keys: dict[str, list[str]] = {}  # req_id -> vector keys it holds
        self._last_layout: tuple | None = None
        self._all_inactive = True
        if device.type == "cuda":
            # Compile the routing kernel now, with the batch's dtypes (query start
            # locations int32, batch row -> slot int64): one token of the sentinel.
            qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
            route_tokens(tables, qsl, torch.full((1,), tables.sentinel, device=device), 1, 1)

    # -------------------------------------------------------------- requests
    def add_request(self, slot: int, req_id: str, prompt_len: int, hooks: dict | None) -> None:
        self.remove_request(req_id)
        t, e = self.t, self.t.max_steers
        words = t.ent_pos.shape[2]
        site = np.full(e, -1, np.int32)
        vec = np.zeros(e, np.int64)
        a = np.zeros(e, np.float32)
        lo = np.full(e, -np.inf, np.float32)
        hi = np.full(e, np.inf, np.float32)
        pos = np.zeros((e, words), np.int32)
        keys = []
        for i, s in enumerate((hooks or {}).get("steer", [])):
            sid = self.sites.id_for_slot(s["layer"], s["kind"])
            if sid is None:  # the frontend checks this; a mismatch must not go unnoticed
                raise RuntimeError(f"graphtap: site {s['layer']}/{s['kind']} is not configured")
            site[i], a[i], lo[i], hi[i] = sid, s["a"], s["lo"], s["hi"]
            vec[i] = self.bank.acquire(s["key"], s["vector"])
            keys.append(s["key"])
            pos[i] = position_bitmap(s["positions"], prompt_len, t.max_len, words)
        if keys:
            self._keys[req_id] = keys
        for dst, src in ((t.ent_site, site), (t.ent_vec, vec), (t.ent_a, a), (t.ent_lo, lo),
                         (t.ent_hi, hi), (t.ent_pos, pos)):
            dst[slot].copy_(host_to_device(src, self.device), non_blocking=True)
        self._last_layout = None  # a slot's meaning may have changed

    def remove_request(self, req_id: str) -> None:
        for key in self._keys.pop(req_id, []):
            self.bank.release(key)

    def has_hooks(self, req_id: str) -> bool:
        return req_id in self._keys

    # -------------------------------------------------------------- steps
    def deactivate(self) -> None:
        if not self._all_inactive:
            self.t.tok_slot.fill_(self.t.sentinel)
            self._all_inactive = True
            self._last_layout = None

    def prepare_step(self, input_batch, dummy_run: bool, also_hooked=lambda req_id: False) -> None:
        """Route token rows to request slots when any request in the batch has hooks
        (steers here, or what `also_hooked` says, e.g. captures)."""
        if dummy_run or not any(self.has_hooks(r) or also_hooked(r) for r in input_batch.req_ids):
            self.deactivate()
            return
        n = input_batch.num_tokens_after_padding
        layout = (tuple(input_batch.req_ids), input_batch.num_tokens, n,
                  input_batch.query_start_loc_np[: input_batch.num_reqs + 1].tobytes())
        if layout == self._last_layout:
            return  # same requests, same token rows: the table already says this
        route_tokens(self.t, input_batch.query_start_loc, input_batch.idx_mapping, n,
                     input_batch.num_reqs)
        self._last_layout = layout
        self._all_inactive = False

