"""Small rows held on the worker until the request may finish: a probe scores every
generated token, and a chunk of its own per request and step (the split, then tensors
serialised by the engine core and decoded by the frontend) cost more than the score;
benchmarks/results has the H200 figures. A held family's step rows are appended here
as arrays, whatever the batch, and a request's rows go home as one chunk at a step that
may finish it: a sampled token that stops it, its length cap, a stop string or a
repetition check (vLLM decides those where graphtap cannot look: every step), a guard
that flags it, or held bytes past their bound. The chunk carries HELD, the positions
computed so far, and the frontend refuses to return rows whose last chunk falls short
of the request's length (courier/assemble.py): a finish nobody foresaw fails the
request's outputs with the reason, it never returns them incomplete.

A request that leaves the batch unfinished (preemption) loses what is held: its
recomputation runs every position again, and the new rows are the ones returned.

Generated positions may come from a device ring instead of step rows (the probe's,
engine/ring.py): `reader` reads a request's ring when it goes home or
its ring fills, and the rows join the held ones."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from graphtap.courier.chunks import ERROR, HELD, error_tensor, positions_key
from graphtap.courier.rows import POSITION, SITE, SLOT


@dataclass(frozen=True)
class Ending:
    """What may finish a request at a step, as vLLM's check_stop sees it."""

    stops: frozenset[int]  # eos (unless ignore_eos) and stop_token_ids
    cap: int  # tokens (prompt + output) at which the length cap finishes it
    every_step: bool  # stop strings or repetition detection: undecidable here

    @classmethod
    def of(cls, params, prompt_len: int, max_model_len: int) -> "Ending":
        stops = set(params.stop_token_ids or ())
        if params.eos_token_id is not None:
            stops.add(params.eos_token_id)
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
        return cls(frozenset(stops), min(prompt_len + max_tokens, max_model_len),
                   bool(params.stop) or params.repetition_detection is not None)

    def may_finish(self, tokens: list[int], total: int) -> bool:
        """`total`: the request's tokens after this step's `tokens` were sampled."""
        return self.every_step or total >= self.cap or not self.stops.isdisjoint(tokens)


NEVER_CAP = 1 << 62  # the cap of a request nobody holds


class HeldRows:
    """One family's held rows (float32 score rows labelled slot, site, position)."""

    def __init__(self, site_names: dict[int, str], max_bytes: int = 64 << 20,
                 reader=None):
        self.site_names = site_names
        self.reader = reader  # engine.ring.ProbeRing, or None
        self._site_ids = {name: i for i, name in site_names.items()}
        self.max_bytes = max_bytes
        self._next = 0
        self._serial: dict[str, int] = {}  # req_id -> serial of its current life
        self._widths: dict[int, dict[int, int]] = {}  # serial -> site -> columns
        self._ending: dict[str, Ending] = {}
        # what a step's check reads without a call per request: each request's length
        # cap (0: every step may finish it), and every stop token of any held request
        self._cap: dict[str, int] = {}
        self._stops: set[int] = set()
        # step arrays, in arrival order: (serial [n], site [n], position [n], rows [n, w])
        self._parts: list[tuple[np.ndarray, ...]] = []
        self._bytes = 0
        self._failed: dict[str, str] = {}  # req_id -> why its rows cannot all come home

    # ---------------------------------------------------------------- requests
    def add_request(self, req_id: str, widths: dict[int, int], ending: Ending) -> None:
        self.remove_request(req_id)
        self._serial[req_id] = serial = self._next
        self._next += 1
        self._widths[serial] = widths
        self._ending[req_id] = ending
        self._cap[req_id] = 0 if ending.every_step else ending.cap
        self._stops |= ending.stops

    def remove_request(self, req_id: str) -> None:
        serial = self._serial.pop(req_id, None)
        self._failed.pop(req_id, None)
        if serial is not None:
            self._ending.pop(req_id, None)
            self._cap.pop(req_id, None)
            if not self._ending:
                self._stops = set()
            del self._widths[serial]  # its rows are dropped at the next compaction

    def holds(self, req_id: str) -> bool:
        return req_id in self._serial

    def __bool__(self) -> bool:  # any request held (its steps must be looked at)
        return bool(self._serial)

    def stats(self) -> dict:
        return {"held_requests": len(self._serial), "held_bytes": self._bytes}

    # ---------------------------------------------------------------- steps
    def step(self, labels: np.ndarray, rows: np.ndarray, slot_to_req: dict[int, str],
             batch: "StepBatch", step, guards: dict) -> dict[str, dict]:
        """One step's rows in; the chunks of the requests that go home now out. `step`:
        the step's ModelRunnerOutput (sampled tokens), None: every held request goes."""
        self.add(labels, rows, slot_to_req)
        due = list(dict.fromkeys(self.due(batch, step)
                                 + self.flagged(labels, rows, slot_to_req, guards)))
        reads, after = due, batch.computed_after.tolist()
        if self.reader is not None:
            reads = list(dict.fromkeys(due + self.reader.filling(batch.req_ids, after)))
        if not reads:
            return {}
        through = {r: t for r, t in zip(batch.req_ids, after) if r in reads}
        if self.reader is not None:
            self.take(self.reader.read_many([(r, through.get(r, 0)) for r in reads]))
        return self.flush(due, through)

    def take(self, found: dict) -> None:
        """Ring reads' rows (request -> engine/ring.py RingRead) joined to the held
        ones, positions the held rows have (routed) left to them; a wanted position in
        neither fails the request's rows."""
        found = {r: read for r, read in found.items() if r in self._serial}
        if not found:
            return
        serials, sites, positions, _ = self._joined()  # once: a take adds its own rows
        rows_of = _grouped(serials)
        for req_id, read in found.items():
            self._take(req_id, read, rows_of(self._serial[req_id]), sites, positions)

    def _take(self, req_id: str, read, mine: np.ndarray, sites: np.ndarray,
              positions: np.ndarray) -> None:
        """take() of one request; `mine`: the indices of its held rows."""
        serial = self._serial[req_id]
        for site, (pos, rows) in read.found.items():
            routed = positions[mine[sites[mine] == site]]
            lost = read.missing[site]
            if routed.size:  # positions that came as rows (mixed steps): theirs
                lost = lost[~np.isin(lost, routed)]
                new = ~np.isin(pos, routed)
                pos, rows = pos[new], rows[new]
            if lost.size and req_id not in self._failed:
                self._failed[req_id] = (
                    f"hooks.probe: {lost.size} wanted position(s) from {int(lost[0])} at "
                    f"{self.site_names[site]} were overwritten in the device ring before "
                    f"they were read (raise hook_config.probe_ring); its probe rows were "
                    f"withheld rather than returned incomplete")
            if len(pos):
                part = (np.full(len(pos), serial, np.int64), np.full(len(pos), site, np.int64),
                        pos.astype(np.int64), np.ascontiguousarray(rows, np.float32))
                self._parts.append(part)
                self._bytes += sum(a.nbytes for a in part)

    def add(self, labels: np.ndarray, rows: np.ndarray, slot_to_req: dict[int, str]) -> None:
        """A step's used rows (host copies of its own), labelled by the step's slots."""
        if not len(labels):
            return
        serial_of = np.full(int(labels[:, SLOT].max()) + 1, -1, np.int64)
        for slot, req in slot_to_req.items():
            serial = self._serial.get(req)
            if serial is not None and slot < len(serial_of):
                serial_of[slot] = serial
        serials = serial_of[labels[:, SLOT]]
        keep = (serials >= 0) & (labels[:, SITE] >= 0)
        if not keep.any():
            return
        part = (serials[keep], labels[keep, SITE].astype(np.int64),
                labels[keep, POSITION].astype(np.int64), rows[keep])
        self._parts.append(part)
        self._bytes += sum(a.nbytes for a in part)

    def due(self, batch: "StepBatch", step) -> list[str]:
        """The batch's held requests this step may finish (or all, past the bound)."""
        if step is None or self._bytes > self.max_bytes:
            return [r for r in batch.req_ids if r in self._serial]
        tokens = getattr(step, "sampled_token_ids", None) or []
        if self._stops.isdisjoint(chain.from_iterable(tokens)):
            # No stop token in the step (the usual one): only a length cap or an
            # every-step check can finish a request. `most` bounds each request's new
            # tokens (one, or more with speculative decoding): erring early only sends
            # a chunk sooner.
            most, cap = max(map(len, tokens), default=1), self._cap.get
            return [r for r, t in zip(batch.req_ids, batch.computed_after.tolist())
                    if t + most >= cap(r, NEVER_CAP)]
        sampled = _sampled_by_request(step)
        out = []
        for req, total in zip(batch.req_ids, batch.computed_after.tolist()):
            ending = self._ending.get(req)
            if ending is None:
                continue
            tokens = sampled.get(req, ())
            if ending.may_finish(tokens, total + len(tokens)):
                out.append(req)
        return out

    def flagged(self, labels: np.ndarray, rows: np.ndarray, slot_to_req: dict[int, str],
                guards: dict) -> list[str]:
        """The step's requests whose stopping guard reads this family and flags one of
        the step's rows (a score past the threshold at a generated position): they go
        home now, and the guard's FINISH then stops them (courier/guard.py)."""
        stops = [(slot, req, guards[req]) for slot, req in slot_to_req.items()
                 if req in guards and guards[req][0].stop
                 and guards[req][0].sources[0] in self._site_ids]
        if not stops or not len(labels):
            return []
        size = int(labels[:, SLOT].max()) + 1
        threshold = np.full(size, np.inf)
        site, column = np.full(size, -2, np.int64), np.zeros(size, np.int64)
        start = np.zeros(size, np.int64)
        for slot, _, (guard, prompt_len) in stops:
            if slot < size:
                threshold[slot], column[slot] = guard.threshold, guard.column
                site[slot], start[slot] = self._site_ids[guard.sources[0]], prompt_len
        s = labels[:, SLOT]
        hit = ((labels[:, SITE] == site[s]) & (labels[:, POSITION] >= start[s])
               & (rows[np.arange(len(s)), column[s]] > threshold[s]))
        return [slot_to_req[x] for x in np.unique(s[hit]).tolist() if x in slot_to_req]

    def flush(self, reqs: list[str], through: dict[str, int]) -> dict[str, dict]:
        """Each request's held rows as one chunk (sites by name, positions, HELD), and
        those rows dropped (with every row of requests no longer held)."""
        if not reqs:  # rows of requests gone since wait for the next flush's compaction
            return {}
        serial, site, pos, rows = self._joined()
        rows_of = _grouped(serial)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for req in reqs:
            s = self._serial.get(req)
            if s is None:
                continue
            mine = rows_of(s)
            chunk: dict[str, torch.Tensor] = {}
            if req in self._failed:
                chunk[ERROR] = error_tensor(self._failed.pop(req))
            for site_id, width in self._widths[s].items():
                at = mine[site[mine] == site_id]
                at = at[np.argsort(pos[at], kind="stable")]  # ring rows join out of order
                name = self.site_names[site_id]
                chunk[name] = _tensor(rows[at, :width])
                chunk[positions_key(name)] = _tensor(pos[at])
            chunk[HELD] = torch.tensor([through.get(req, 0)], dtype=torch.int64)
            out[req] = chunk
        gone = {self._serial[r] for r in out}
        live = np.array(sorted(self._widths.keys() - gone), np.int64)
        keep = np.isin(serial, live)
        self._parts = [(serial[keep], site[keep], pos[keep], rows[keep])] if keep.any() else []
        self._bytes = sum(a.nbytes for p in self._parts for a in p)
        return out

    def _joined(self) -> tuple[np.ndarray, ...]:
        if not self._parts:
            return (np.zeros(0, np.int64),) * 3 + (np.zeros((0, 1), np.float32),)
        if len(self._parts) > 1:
            width = max(p[3].shape[1] for p in self._parts)
            rows = np.concatenate([p[3] if p[3].shape[1] == width else
                                   np.pad(p[3], ((0, 0), (0, width - p[3].shape[1])))
                                   for p in self._parts])
            self._parts = [tuple(np.concatenate([p[i] for p in self._parts])
                                 for i in range(3)) + (rows,)]
        return self._parts[0]


def _grouped(serials: np.ndarray):
    """serial -> the indices of its rows, in order, from one sort (not a comparison of
    every held row per request: a batch finishing at one step flushes them all)."""
    order = np.argsort(serials, kind="stable")
    keys = serials[order]
    return lambda s: order[np.searchsorted(keys, s, "left"):np.searchsorted(keys, s, "right")]


class NoRows:
    """A step in which a held family wrote no rows: its held requests of the batch may
    still finish (a probe of prompt positions, decoding), so the step set asks."""

    slot_to_req: dict[int, str] = {}

    def __init__(self, held: HeldRows):
        self.held = held

    def to_cpu_nonblocking(self) -> None:
        pass

    def release_device(self) -> None:
        pass

    def overflow(self) -> dict:
        return {}

    _EMPTY = (np.zeros((0, 3), np.int64), np.zeros((0, 1), np.float32))

    def host_rows(self) -> tuple[np.ndarray, np.ndarray]:
        return self._EMPTY


@dataclass
class StepBatch:
    """The batch a step ran, as the host saw it at the step's end."""

    req_ids: list[str]
    computed_after: np.ndarray  # per batch row: tokens computed once the step ran

    @classmethod
    def of(cls, input_batch) -> "StepBatch":
        n = input_batch.num_reqs
        computed = getattr(input_batch, "num_computed_tokens_np", None)
        scheduled = np.asarray(input_batch.num_scheduled_tokens[:n], np.int64)
        after = scheduled if computed is None else computed[:n].astype(np.int64) + scheduled
        return cls(list(input_batch.req_ids[:n]), after)


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor of its own. Not torch.from_numpy of an empty selection: numpy gives it
    stride 0, which vLLM's msgpack encoder cannot view as bytes, and the engine core's
    output thread died of it (the engine then hung: a request with no generated row)."""
    if not a.size:
        return torch.empty(a.shape, dtype=torch.from_numpy(a[:0].copy()).dtype)
    return torch.from_numpy(np.ascontiguousarray(a).copy())


def _sampled_by_request(step) -> dict[str, list[int]]:
    if step is None or not getattr(step, "sampled_token_ids", None):
        return {}
    return dict(zip(step.req_ids, step.sampled_token_ids))
