"""Probes: linear probes scored on the device at residual sites (ops/probe*.py), one
buffer row of P float32 scores per wanted (site, token), returned per request as
`probe:<site>` like a capture; generated positions' scores wait in a device ring
instead while the request decodes (engine/ring.py). Their weight vectors live in the
steering bank (content-keyed, refcounted), which the frontend's admission already
bounds."""
from __future__ import annotations

import numpy as np
import torch

from graphtap.courier import CaptureStep, OverflowKind, RequestErrors, RowFormat, StepSnapshots
from graphtap.courier.held import Ending, HeldRows, NoRows
from graphtap.courier.rows import HOST_LABELS
from graphtap.engine.families.vectors import BankFull, VectorBank
from graphtap.engine.ring import ProbeRing, RingEntry
from graphtap.engine.rows import RowFamily
from graphtap.engine.tables import ProbeFields
from graphtap.engine.wanted import batch_windows
from graphtap.spec.entries import NormalisedSpec
from graphtap.spec.positions import position_mask


class RingStep:
    """A step whose probed requests' wanted positions all go to the ring: the router
    maps tokens to slots, the probe routes no rows."""


RING_STEP = RingStep()


class ProbeFamily(RowFamily):
    """Probe scores of residual sites; one buffer row per wanted token and site."""

    name = "probe"
    step_class = CaptureStep
    overflow_kind = OverflowKind.PROBE_ROWS
    host_labels = HOST_LABELS
    remember_plans = False  # its entries hold the probes' weights: hashing costs
    # The ring writes slots' ring_from outside add_request, and resets still skip the
    # slots the block holds inactive (engine/slots.py): the ring writes a start only
    # into a claimed slot (a request with probe entries), elsewhere "never", the
    # inactive value (tests/test_probe_ring.py holds the device to the host).

    def __init__(self, tables, fields: ProbeFields, slots, *args, bank: VectorBank,
                 **kwargs):
        super().__init__(tables, fields.entries, slots, *args, **kwargs)
        self.extra, self.bank = fields, bank
        self.extra_fields = (fields.vec, fields.bias, fields.act, fields.ring_from)
        self.site_names = {i: f"probe:{n}" for i, n in self.site_names.items()}
        self.ring = ProbeRing(tables, slots.host_view(fields.ring_from)[:, 0])
        # Scores stay on the worker (the device ring, then its host) until the request
        # may finish.
        self.held = HeldRows(self.site_names, reader=self.ring)
        self._keys: dict[str, list[str]] = {}  # req_id -> bank keys it holds
        self._rows: list[list[int]] = []  # bank rows of the request being added
        self._refused: dict[str, str] = {}

    def entries(self, spec: NormalisedSpec) -> tuple:
        return spec.probe

    def kind_of(self, entry) -> str:
        return entry.kind

    def describe(self, entry, dtype: torch.dtype) -> tuple[RowFormat, int]:
        return RowFormat(torch.float32, len(entry.vectors), None, 0), 1

    def split_rows(self, slots) -> bool:
        return False  # residual scores, whole on every rank

    def columns(self, slots, batch) -> int:
        return max((f.width for s in slots for f in self._formats[s].values()), default=0)

    def add_request(self, slot: int, req_id: str, prompt_len: int,
                    spec: NormalisedSpec) -> None:
        self.remove_request(req_id)
        vectors = [(k, d) for entry in spec.probe for k, d in zip(entry.keys, entry.vectors)]
        try:
            flat = self.bank.acquire_all(vectors)
        except BankFull as e:  # refuse the request, never raise: the engine would die
            self.reset_slot(slot)
            self.ring.free_slot(slot)
            self._refused[req_id] = f"hooks.probe: {e}: this request ran without its probes"
            return
        held, rows = [k for k, _ in vectors], []
        for entry in spec.probe:
            rows.append(flat[:len(entry.vectors)])
            flat = flat[len(entry.vectors):]
        self._rows = rows
        super().add_request(slot, req_id, prompt_len, spec)
        self._rows = []
        if held:
            self._keys[req_id] = held
        self._use_ring(slot, req_id, prompt_len, spec)

    def _use_ring(self, slot: int, req_id: str, prompt_len: int,
                  spec: NormalisedSpec) -> None:
        """Generated positions go to the ring, unless a stopping probe guard needs every
        step's scores on the host."""
        if not spec.probe or req_id not in self._slot_of:  # none, or refused
            self.ring.free_slot(slot)
            return
        guard = spec.guard
        stops = guard is not None and guard.stop and guard.kind == "probe"
        entries = []
        for i, entry in enumerate(spec.probe):
            mask = position_mask(entry.positions, prompt_len, self.max_len)
            if mask[prompt_len:].any():
                entries.append(RingEntry(i, self.sites.id_of(entry.layer, entry.kind),
                                         mask, len(entry.vectors)))
        self.ring.add_request(slot, req_id, prompt_len, [] if stops else entries,
                              stops and bool(entries))

    def write_extra(self, slot: int, i: int, entry) -> None:
        x, view = self.extra, self.slots.host_view
        rows = self._rows[i]
        view(x.vec)[slot, i, :len(rows)] = rows
        view(x.bias)[slot, i, :len(rows)] = entry.bias
        view(x.act)[slot, i] = int(entry.sigmoid)

    def hold(self, req_id: str, ending: Ending) -> None:
        """Hold the request's rows until a step `ending` says may finish it."""
        if req_id in self._slot_of:
            slot = self._slot_of[req_id]
            widths = {site: f.width for site, f in self._formats[slot].items()}
            self.held.add_request(req_id, widths, ending)
            if ending.every_step and self.ring.holds(req_id):
                # Its rows go home every step anyway (stop strings): a ring read per step
                # would cost more than the routed rows.
                self.ring.to_rows(slot, req_id)
                self.slots.stage(slot)

    def remove_request(self, req_id: str) -> None:
        self._refused.pop(req_id, None)
        self.held.remove_request(req_id)
        self.ring.remove_request(req_id)
        if req_id in self._slot_of:
            self.ring.free_slot(self._slot_of[req_id])
        super().remove_request(req_id)
        for key in self._keys.pop(req_id, []):
            self.bank.release(key)

    def plan(self, input_batch):
        """The rows bound, or RING_STEP when every batch row that may want rows now is
        one the ring takes whole (decoding): no routing, no rows. A decode step is
        decided in one pass over per-slot arrays; other steps ask the want table."""
        if not self._wanted:
            return 0
        w = batch_windows(input_batch)
        if w is not None and self.ring.takes_all(w.slots, w.lo, w.tokens):
            return RING_STEP if self.ring.uses(w.slots).any() else 0
        return self.plan_rows(input_batch, w)

    def plan_rows(self, input_batch, w) -> "int | RingStep":
        """plan() from the want table: the rows the batch's requests may want now, or
        RING_STEP if the ring takes every one of them."""
        rows = self._table.rows(input_batch)
        if rows is None or w is None:
            return super().plan(input_batch)
        wanting = np.flatnonzero(rows)
        if not len(wanting):
            return 0
        if self.ring.serves(w.slots[wanting], w.lo[wanting], w.tokens[wanting]).all():
            return RING_STEP
        return int(rows.sum())

    def rows_to_route(self, plan):
        return None if plan is RING_STEP else self.t

    def route(self, input_batch, router, plan) -> None:
        if plan is RING_STEP:
            self.deactivate()  # every token routes nowhere; the op fills the ring
            self.ring.steps += 1
        else:
            super().route(input_batch, router, plan)

    def apply_staged_writes(self) -> None:
        self.bank.apply()  # shared with steering: whichever runs first writes the rows

    def stats(self) -> dict:
        return {**super().stats(), **self.held.stats(), **self.ring.stats()}

    def snapshot(self):
        step = super().snapshot()
        if step is not None:
            step.held = self.held
        elif self.held:
            step = NoRows(self.held)
        if not self._refused:
            return step
        errors, self._refused = RequestErrors(self._refused), {}
        return errors if step is None else StepSnapshots([step, errors])
