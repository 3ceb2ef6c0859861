"""Steering: per-request entries in the slot block and the resident vectors. The op
(ops/steer*.py) reads them with the router's token -> slot map and evaluates position
rules from each token's actual position, so chunked prefill, preemption and speculative
decoding need nothing here. A conditional steer's gate is decided by the op itself at
the condition's site; here it is only cleared, with the rest of a refilled slot."""
from __future__ import annotations

import dataclasses

import numpy as np

from graphtap.courier import RequestErrors
from graphtap.engine.families.vectors import BankFull, VectorBank
from graphtap.engine.family import FamilyBase
from graphtap.engine.tables import EngineTables
from graphtap.ops.tables import COND_BELOW, COND_SIGMOID, COND_UNIT
from graphtap.spec.entries import ConditionEntry, NormalisedSpec
from graphtap.spec.positions import position_bitmap
from graphtap.spec.sites import SiteTable

BITMAPS = 256  # (position rule, prompt length) bitmaps a family remembers


class SteerFamily(FamilyBase):
    """Per-request edits of the residual stream."""

    name = "steer"

    def __init__(self, tables: EngineTables, sites: SiteTable, bank: VectorBank):
        self.t = tables.ops.steer
        self.slots, self.fields = tables.slots, tables.steer
        self.sites = sites
        self.bank = bank  # the engine's resident vectors (probes share them)
        # a burst's requests share a rule and a prompt length: one bitmap each, made once
        # (made per request, it was a third of a steering request's admission)
        self._bitmaps: dict[tuple, np.ndarray] = {}
        self._keys: dict[str, list[str]] = {}  # req_id -> vector keys it holds
        self._refused: dict[str, str] = {}  # req_id -> why, until the next step reports it
        self._slot_of: dict[str, int] = {}
        self._heads: set[str] = set()  # requests that steer heads at attn.hook_z
        self._fields = self.slots.group(self.fields.all)  # reset together
        # slot -> the columns its request set, where they were staged alone (a long
        # max_model_len's rows: stage_runs), to be put back at its removal
        self._runs: dict[int, np.ndarray] = {}
        # per field, where its columns start and how many an entry has (entries side by
        # side in a field's columns)
        self._per_entry = {d.name: (f.offset, f.size // f.shape[0])
                           for d in dataclasses.fields(self.fields)
                           for f in (getattr(self.fields, d.name),)}
        # the fields' host views, made once (the host block never moves): four views a
        # request were a third of a steering request's admission here
        self._host = {name: self.slots.host_view(getattr(self.fields, name))
                      for name in ("site", "vec", "coef", "pos", "cond_site", "cond_vec",
                                   "cond_mode", "cond_coef", "cond_pos")}

    def add_request(self, slot: int, req_id: str, prompt_len: int,
                    spec: NormalisedSpec) -> None:
        self.remove_request(req_id)
        wanted = [(s.key, s.vector) for s in spec.steer] + \
            [(s.condition.key, s.condition.vector) for s in spec.steer if s.condition]
        # a long max_model_len's row is hundreds of KiB (every entry's bitmap of every
        # family), of which a steering request sets a few columns: a clean slot is
        # claimed and only those staged (a refilled slot's gates start undecided, off)
        by_runs = bool(wanted) and self.slots.stages_runs() and \
            self.slots.claim_clean(slot, self._fields)
        if not by_runs:
            self.slots.reset(slot, self._fields, claim=bool(wanted))
        if not wanted:  # its fields stay inactive: nothing to look up (a capture request)
            return
        try:
            rows = self.bank.acquire_all(wanted)
        except BankFull as e:  # refuse the request, never raise: the engine would die
            self._refused[req_id] = f"hooks.steer: {e}: this request ran unsteered"
            if by_runs:  # nothing written: the slot is still clean
                self._fields.clean[slot] = 1
            return
        h = self._host
        site, vec, coef, pos = h["site"][slot], h["vec"][slot], h["coef"][slot], h["pos"][slot]
        cond_rows = iter(rows[len(spec.steer):])
        for i, s in enumerate(spec.steer):
            site[i] = self.sites.id_of(s.layer, s.kind)
            vec[i] = rows[i]
            coef[i] = (s.a, s.lo, s.hi, s.g)
            pos[i] = self._bitmap(s.positions, prompt_len, pos.shape[1])
            if s.condition is not None:
                self._write_condition(slot, i, s.condition, next(cond_rows), prompt_len)
        self._keys[req_id] = [key for key, _ in wanted]
        self._slot_of[req_id] = slot
        if by_runs:
            runs = self._set_runs(spec, pos)
            self._runs[slot] = runs
            self.slots.stage_runs(slot, runs)
        if any(s.kind == "attn_z" for s in spec.steer):
            self._heads.add(req_id)

    def _set_runs(self, spec: NormalisedSpec, pos: np.ndarray) -> np.ndarray:
        """The columns a request's entries set, as runs [m, 2]: per entry its fields'
        columns (its gate's included, whose device value the op may have changed), of
        its bitmap the words from the first set bit's to the last's, and its
        condition's fields where it has one."""
        runs = []
        for i, s in enumerate(spec.steer):
            names = ("site", "vec", "coef", "gate") + (
                ("cond_site", "cond_vec", "cond_mode", "cond_coef", "cond_pos")
                if s.condition is not None else ())
            for name in names:
                at, n = self._per_entry[name]
                runs.append((at + i * n, at + (i + 1) * n))
            set_words = np.flatnonzero(pos[i])
            if len(set_words):
                at, n = self._per_entry["pos"]
                runs.append((at + i * n + set_words[0], at + i * n + set_words[-1] + 1))
        return np.array(runs, np.int64)

    def _bitmap(self, rule, prompt_len: int, words: int):
        key = (rule, prompt_len)
        bitmap = self._bitmaps.get(key)
        if bitmap is None:
            bitmap = self._bitmaps[key] = position_bitmap(rule, prompt_len, self.t.max_len,
                                                          words)
            bitmap.flags.writeable = False  # shared by the requests that ask it
            if len(self._bitmaps) > BITMAPS:
                del self._bitmaps[next(iter(self._bitmaps))]  # the oldest
        return bitmap

    def _write_condition(self, slot: int, i: int, c: ConditionEntry, row: int,
                         prompt_len: int) -> None:
        h = self._host
        h["cond_site"][slot, i] = self.sites.id_of(c.layer, c.kind)
        h["cond_vec"][slot, i] = row
        h["cond_mode"][slot, i] = COND_UNIT * c.unit + COND_SIGMOID * c.sigmoid + \
            COND_BELOW * c.below
        h["cond_coef"][slot, i] = (c.bias, c.threshold)
        h["cond_pos"][slot, i] = prompt_len - 1

    def remove_request(self, req_id: str) -> None:
        self._refused.pop(req_id, None)
        self._heads.discard(req_id)
        for key in self._keys.pop(req_id, []):
            self.bank.release(key)
        slot = self._slot_of.pop(req_id, None)
        if slot is None:
            return
        runs = self._runs.pop(slot, None)
        if runs is not None:  # the columns it set back to inactive: clean again
            self.slots.release_runs(slot, self._fields, runs)
        else:  # inactive again (written with the next staged writes)
            self.slots.reset(slot, self._fields, claim=False)

    def stats(self) -> dict:
        return {"requests": len(self._keys), "vectors_held": self.bank.held(),
                "vectors_resident": self.bank.resident(),
                "active_slots": int((self.slots.host_view(self.fields.site) >= 0)
                                    .any(axis=1).sum())}

    def snapshot(self):
        """The step's refusals, each delivered as its request's error."""
        if not self._refused:
            return None
        errors, self._refused = self._refused, {}
        return RequestErrors(errors)

    def apply_staged_writes(self) -> None:
        self.bank.apply()

    def plan(self, input_batch) -> bool:
        """Whether a request of the batch steers: the router must then map its tokens."""
        return bool(self._keys) and any(r in self._keys for r in input_batch.req_ids)

    def steers_heads(self, input_batch) -> bool:
        """Whether a request of the batch steers heads: the z op, whose slot carries no
        positions, then reads the router's copy of them."""
        return bool(self._heads) and any(r in self._heads for r in input_batch.req_ids)
