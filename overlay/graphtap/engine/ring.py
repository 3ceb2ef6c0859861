"""The probe ring: generated positions' probe scores stay on the device, in a ring per
request slot and entry that the probe op fills inside the graph (ops/probe.py), until the
host reads a request's ring: at a step that may finish it (courier/held.py says which)
or once its unread positions reach half the ring. A decode step of probed requests then
routes nothing, clones nothing and copies nothing home; those per-step rows were what a
probe cost at 16 requests a second on the H200 (benchmarks/results).

Rows still carry what routed rows do: prompt positions, and the whole of any step in
which a probed request runs more than a quarter of the ring at once (a chunked prefill,
a recomputation after preemption) or has a stopping probe guard (which needs every
step's scores on the host), are routed as before; the ring takes the wanted positions
at or past the prompt that routed nowhere. Each ring row holds the position it was
written for, written with it. A read keeps the rows whose label is the position it
expects, leaves positions that came as routed rows to those, and fails the request if a
wanted position is in neither: never a short set.

Async scheduling runs one step ahead while a read copies: a step writes at most a
quarter of the ring per request and reads start at half, so the rows read are never
the ones being overwritten; the labels would say so if they were."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from graphtap.ops.tables import RING_NEVER, ProbeTables


@dataclass
class RingEntry:
    """A probe entry of a request that wants generated positions from the ring."""

    entry: int  # index among the slot's probe entries
    site: int
    mask: np.ndarray  # bool over positions: the entry's wanted positions
    width: int  # scores per row


@dataclass
class _Request:
    slot: int
    start: int  # the first position not read yet
    entries: list[RingEntry]


@dataclass
class RingRead:
    """What one read found for a request, per entry of positions it wanted in [start,
    through): the ring's rows for those it holds, and those it does not (overwritten, or
    never written there because they came as routed rows)."""

    found: dict[int, tuple[np.ndarray, np.ndarray]]  # site -> (positions, rows)
    missing: dict[int, np.ndarray]  # site -> positions


class ProbeRing:
    """The host side of the ring: who uses it, from where, and its reads."""

    def __init__(self, t: ProbeTables, ring_from: np.ndarray):
        """`ring_from`: the host view of the slots' ring_from field ([slots], written
        here, staged by the family): the one copy of where each slot's ring starts."""
        self.t = t
        self.size = t.ring_size
        self.step_limit = self.size // 4  # tokens of one request a ring step may run
        self._reqs: dict[str, _Request] = {}
        self._half_at: dict[str, int] = {}  # req_id -> where its unread reach half the ring
        self.steps = self.reads = self.fetches = 0  # counters (stats: *_total)
        self.read_s = 0.0  # host time in reads (a read waits for its copy)
        self.ring_from = ring_from
        # per slot, for the step plan's one pass: from where on the ring (or nothing)
        # takes all the slot's probes want (0: no probes; RING_NEVER: rows, always)
        self.ring_ok_from = np.zeros(len(ring_from), np.int64)
        device = t.ring.device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # a fetch takes up to _chunk slots at once, into pinned buffers of that many
        # (at most 64 slots and 8 MiB: a large probe_ring fetches fewer at once)
        slot_bytes = t.ring[0].nbytes + t.ring_pos[0].nbytes
        self._chunk = max(1, min(len(ring_from), 64, (8 << 20) // slot_bytes))
        self._host = ()
        if self._stream is not None:
            self._host = (torch.empty((self._chunk, *t.ring.shape[1:]), dtype=t.ring.dtype,
                                      pin_memory=True),
                          torch.empty((self._chunk, *t.ring_pos.shape[1:]),
                                      dtype=t.ring_pos.dtype, pin_memory=True))

    def add_request(self, slot: int, req_id: str, prompt_len: int,
                    entries: list[RingEntry], rows_past_prompt: bool = False) -> None:
        """Sets the slot's ring_from: the prompt's end, or RING_NEVER without entries.
        `rows_past_prompt`: the request wants generated positions as routed rows."""
        self.remove_request(req_id)
        self.ring_ok_from[slot] = RING_NEVER if rows_past_prompt else prompt_len
        if not entries:
            self.ring_from[slot] = RING_NEVER
            return
        self._reqs[req_id] = _Request(slot, prompt_len, entries)
        self._half_at[req_id] = prompt_len + self.size // 2
        self.ring_from[slot] = prompt_len

    def remove_request(self, req_id: str) -> None:
        r = self._reqs.pop(req_id, None)
        self._half_at.pop(req_id, None)
        if r is not None:
            self.ring_from[r.slot] = RING_NEVER

    def to_rows(self, slot: int, req_id: str) -> None:
        """The request's generated positions are routed rows from now on (the family
        stages its slot, so ring_from is RING_NEVER on the device before its next step)."""
        self.remove_request(req_id)
        self.ring_ok_from[slot] = RING_NEVER

    def free_slot(self, slot: int) -> None:
        """The slot holds no probes now (its request left, or holds none)."""
        self.ring_ok_from[slot] = 0
        self.ring_from[slot] = RING_NEVER

    def holds(self, req_id: str) -> bool:
        return req_id in self._reqs

    def stats(self) -> dict:
        return {"ring_requests": len(self._reqs), "ring_steps_total": self.steps,
                "ring_reads_total": self.reads, "ring_fetches_total": self.fetches,
                "ring_read_ms_total": round(self.read_s * 1e3, 3)}

    def serves(self, slots: np.ndarray, lo: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Per batch row (slot, first position, tokens): whether the ring takes all that
        the row may want this step."""
        return (lo >= self.ring_from[slots]) & (tokens <= self.step_limit)

    def uses(self, slots: np.ndarray) -> np.ndarray:
        """Per slot: whether its request's generated positions go to the ring."""
        return self.ring_from[slots] != RING_NEVER

    def takes_all(self, slots: np.ndarray, lo: np.ndarray, tokens: np.ndarray) -> bool:
        """Whether in a step with these batch rows (slot, first position, tokens) the
        ring, or nothing, takes every probe row: no row needs routing."""
        return bool(((lo >= self.ring_ok_from[slots])
                     & (~self.uses(slots) | (tokens <= self.step_limit))).all())

    def filling(self, req_ids: list[str], through: list[int]) -> list[str]:
        """The requests whose unread positions reached half the ring."""
        due = self._half_at.get
        return [r for r, t in zip(req_ids, through) if t >= due(r, RING_NEVER)]

    def read_many(self, items: list[tuple[str, int]]) -> dict[str, RingRead]:
        """Each (request, through)'s ring rows of positions [start, through), and what
        it wanted there; its start moves to through (requests with nothing to read are
        left out). Their slots are fetched together: one wait for all their copies, not
        one per request (a batch admitted at once reads every ring at one step)."""
        todo = [(req, through, r) for req, through in items
                if (r := self._reqs.get(req)) is not None and through > r.start]
        out: dict[str, RingRead] = {}
        for i in range(0, len(todo), self._chunk):
            part = todo[i:i + self._chunk]
            t0 = time.perf_counter()
            vals, labels = self._fetch([r.slot for _, _, r in part])
            self.read_s += time.perf_counter() - t0
            self.reads += len(part)
            self.fetches += 1
            for k, (req, through, r) in enumerate(part):
                out[req] = self._rows(r, through, vals[k], labels[k])
                self._half_at[req] = through + self.size // 2
        return out

    def _rows(self, r: _Request, through: int, vals: np.ndarray,
              labels: np.ndarray) -> RingRead:
        pos = np.arange(r.start, through)
        found, missing = {}, {}
        for e in r.entries:
            want = pos[e.mask[r.start:through]]
            if not len(want):
                continue
            here = labels[e.entry, want % self.size] == want
            found[e.site] = (want[here], vals[e.entry, want[here] % self.size, :e.width])
            missing[e.site] = want[~here]
        r.start = through
        return RingRead(found, missing)

    def _fetch(self, slots: list[int]) -> tuple[list | np.ndarray, list | np.ndarray]:
        """The slots' rings and labels on the host, in the order given. On a GPU on a
        stream of its own, into pinned buffers, one wait for all: the step whose rows
        are read has finished (its output copy event), the one running now writes other
        rows of the ring. Views: _rows() indexes out copies of its own."""
        if self._stream is None:
            return ([self.t.ring[s].numpy() for s in slots],
                    [self.t.ring_pos[s].numpy() for s in slots])
        vals, labels = self._host
        with torch.cuda.stream(self._stream):
            for k, slot in enumerate(slots):
                vals[k].copy_(self.t.ring[slot], non_blocking=True)
                labels[k].copy_(self.t.ring_pos[slot], non_blocking=True)
        self._stream.synchronize()
        return vals[:len(slots)].numpy(), labels[:len(slots)].numpy()
