"""Whole step chunks held on the worker until the request may finish (hook_config
`hold_outputs_bytes` > 0; off by default).

The frontend returns a request's hook outputs only when it finishes (assemble.py), yet
each step's chunk travels with that step's tokens: a prompt's captured rows travel with
its first token, and a burst's first tokens wait for them (the split's output through
the engine core's message and the frontend's decoding: qk's 1 MiB of k rows a request).
Held, a request's chunks stay on the worker, as the split made them, and go home
together at a step that may finish it, decided as for held probe rows (held.py's
Ending: a stop token sampled, its length cap, or every step where vLLM checks stop
strings or repetitions, which are not held at all), or when a guard finishes it, or
when the held bytes pass their bound. Each such send carries HELD (the positions
computed so far), and the frontend withholds the outputs of a request whose last send
falls short of its length: an abort, or a finish decided outside vLLM's stop checks,
fails its outputs with the reason, never returns them incomplete.

A request that leaves the batch unfinished (preemption) loses what is held: its
recomputation runs every position again and sends them.

Whole steps are held too (step_snapshots): a step whose rows all belong to held
requests, none of them going now, is kept as its copied rows, unsplit, and split only
at a step where one of its requests goes (or the bound is passed). The split of a
prompt's rows (tens of microseconds a request, more than a millisecond a prefill step
of hs captures on the H200 host) then runs at the finishing step, not on the way to
the burst's first tokens. Only small steps are held whole (WHOLE_STEP_BYTES): a large
step's split grows with its rows and, done as it comes, runs while the device computes
the next step; held, it would land on the finishing step, where every request of the
batch waits for it (qk's prefill steps did, on the H200). Steps with guards, held probe
rows or sink rows are split as they come. A held step is split whole, together with
every older held step that shares a request with it, oldest first, so each request's
chunks keep step order; rows of a request that left since (or left and came back) are
dropped there."""
from __future__ import annotations

import itertools

import torch

from graphtap.courier.chunks import FINISH, HELD
from graphtap.courier.held import Ending, StepBatch, _sampled_by_request


# the largest step copy held unsplit: a step of last-prompt residual captures (a few rows
# a request) is well below it, a prefill step of every prompt position's k rows above
WHOLE_STEP_BYTES = 1 << 20


def holds_outputs(spec, params, max_bytes: int) -> bool:
    """Whether a request's chunks are held (frontend and worker decide alike): it
    returns rows, the engine holds outputs, and no step-by-step stop check (stop strings,
    repetition detection) could finish it at a step graphtap cannot foresee."""
    if max_bytes <= 0 or params is None or not spec.captures_anything:
        return False
    return not (bool(params.stop) or params.repetition_detection is not None)


class HeldChunks:
    """One worker's held chunks, per request in step order, and what may finish each."""

    def __init__(self, max_bytes: int, whole_step_bytes: int = WHOLE_STEP_BYTES):
        self.max_bytes, self.whole_step_bytes = max_bytes, whole_step_bytes
        self._ending: dict[str, Ending] = {}
        self._chunks: dict[str, list[dict[str, torch.Tensor]]] = {}
        self._bytes: dict[str, int] = {}
        # whole steps held unsplit, oldest first: (snapshot, its requests' generations,
        # its bytes); a generation tells a request that left and came back from before
        self._steps: list[tuple[object, dict[str, int], int]] = []
        self._gen: dict[str, int] = {}
        self._gens = itertools.count()
        # counters (stats): chunks kept, sends, sends forced by the bound, steps held whole
        self.kept, self.sends, self.bound_sends, self.steps_kept = 0, 0, 0, 0

    def add_request(self, req_id: str, ending: Ending) -> None:
        self.remove_request(req_id)
        self._ending[req_id] = ending
        self._gen[req_id] = next(self._gens)

    def remove_request(self, req_id: str) -> None:
        self._ending.pop(req_id, None)
        self._chunks.pop(req_id, None)
        self._bytes.pop(req_id, None)
        if self._gen.pop(req_id, None) is not None and self._steps:
            # a held step with no live request left holds nothing anyone gets
            self._steps = [s for s in self._steps
                           if any(self._gen.get(r) == g for r, g in s[1].items())]

    def holds(self, req_id: str) -> bool:
        return req_id in self._ending

    def any_in(self, req_ids) -> bool:
        return bool(self._ending) and any(r in self._ending for r in req_ids)

    def stats(self) -> dict:
        return {"held_chunk_requests": len(self._ending),
                "held_chunk_bytes": self._held_bytes(), "held_steps": len(self._steps),
                "chunks_kept_total": self.kept, "sends_total": self.sends,
                "bound_sends_total": self.bound_sends, "steps_kept_total": self.steps_kept}

    def _held_bytes(self) -> int:
        return sum(self._bytes.values()) + sum(s[2] for s in self._steps)

    def step_snapshots(self, snap, step) -> dict[str, list[dict[str, torch.Tensor]]]:
        """A step's snapshot (courier.snapshot.StepSnapshots, its rows copied home) in,
        what goes home now out, as `step` returns it; the snapshot is held whole when
        it may be (the module's docstring)."""
        reqs = snap.requests() if snap.may_wait() else set()
        size = snap.nbytes() if reqs else 0
        whole = bool(reqs) and size <= self.whole_step_bytes and \
            all(r in self._ending for r in reqs)
        chunks = {} if whole else snap.chunks(step)
        coming = _coming_bytes(chunks, self._ending) + (size if whole else 0)
        after, due = self._decide(snap.batch, chunks, step, coming)
        if whole and not reqs.isdisjoint(due):  # one of its requests goes now
            whole, chunks = False, snap.chunks(step)
        self._split_held_steps(set(due) | (set() if whole else set(chunks)))
        if whole:
            snap.release_parts()
            self._steps.append((snap, {r: self._gen[r] for r in reqs}, size))
            self.steps_kept += 1
        return self._send(chunks, due, after)

    def _split_held_steps(self, going: set[str]) -> None:
        """Splits the held steps with a request in `going`, and every older one that
        shares a request with a step split (so each request's chunks stay in step
        order), oldest first; keeps their chunks as the split made them."""
        if not self._steps or not going:
            return
        split = []
        for i in range(len(self._steps) - 1, -1, -1):  # newest first: the closure
            gens = self._steps[i][1]
            if not going.isdisjoint(gens):
                split.append(i)
                going = going | gens.keys()
        for i in reversed(split):  # oldest first
            snap, gens, _ = self._steps[i]
            for req, chunk in snap.chunks(None).items():
                if self._gen.get(req) == gens.get(req):  # still the request it was
                    self._keep(req, chunk)
        for i in split:  # descending: the indices stay valid
            del self._steps[i]

    def _keep(self, req: str, chunk: dict[str, torch.Tensor]) -> None:
        self._chunks.setdefault(req, []).append(chunk)
        self.kept += 1
        self._bytes[req] = self._bytes.get(req, 0) + _kept_bytes(chunk)

    def _send(self, chunks: dict, due: list[str], after: dict[str, int]) -> dict:
        """The step's chunks of requests nobody holds; the held ones kept; and the
        chunks of each request in `due`, in step order, closed by HELD."""
        out = {r: [c] for r, c in chunks.items() if r not in self._ending}
        for req, chunk in chunks.items():
            if req in self._ending:
                self._keep(req, chunk)
        self.sends += len(due)
        for req in due:
            sent = self._chunks.pop(req, [])
            self._bytes.pop(req, None)
            # the positions computed so far: the frontend checks the last send covers all
            sent.append({HELD: torch.tensor([after.get(req, 0)], dtype=torch.int64)})
            out[req] = sent
        return out

    def step(self, chunks: dict[str, dict[str, torch.Tensor]], batch: StepBatch | None,
             step) -> dict[str, list[dict[str, torch.Tensor]]]:
        """The step's chunks in; what goes home now out (per request, its chunks in step
        order). `step`: the step's ModelRunnerOutput (sampled tokens); None, or no
        batch: every held request of the step goes."""
        after, due = self._decide(batch, chunks, step, _coming_bytes(chunks, self._ending))
        self._split_held_steps(set(due) | set(chunks))
        return self._send(chunks, due, after)

    def _decide(self, batch: StepBatch | None, chunks: dict, step,
                coming: int) -> tuple[dict[str, int], list[str]]:
        """The batch's tokens computed per request (empty: no batch), and which held
        requests of the step (in the batch or with chunks) go now."""
        after = dict(zip(batch.req_ids, batch.computed_after.tolist())) if batch else {}
        held_here = [r for r in dict.fromkeys([*(batch.req_ids if batch else ()), *chunks])
                     if r in self._ending]
        return after, self._due(held_here, chunks, after, step, coming) if held_here else []

    def _due(self, reqs: list[str], chunks: dict, after: dict[str, int], step,
             coming: int = 0) -> list[str]:
        """`after`: the batch's tokens computed per request (empty: no batch); `coming`:
        the bytes this step would add to those held."""
        if not after or step is None:
            return reqs
        if self._held_bytes() + coming > self.max_bytes:
            self.bound_sends += len(reqs)
            return reqs
        sampled = _sampled_by_request(step)
        due = []
        for req in reqs:
            tokens = sampled.get(req, ())
            # a request the batch does not name has nothing to wait for
            if req not in after or FINISH in chunks.get(req, ()) or \
                    self._ending[req].may_finish(tokens, after[req] + len(tokens)):
                due.append(req)
        return due


def _coming_bytes(chunks: dict, held: dict) -> int:
    return sum(_kept_bytes(c) for r, c in chunks.items() if r in held)


def _kept_bytes(chunk: dict[str, torch.Tensor]) -> int:
    """Host bytes a held chunk keeps alive: its tensors may be views of the step's whole
    pinned copy (the split does not copy rows that sit in order), so each distinct
    storage counts whole. A step's copy shared by several held requests counts for each:
    the bound errs towards sending early, never towards holding more than it says."""
    seen: dict[int, int] = {}
    for t in chunk.values():
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
