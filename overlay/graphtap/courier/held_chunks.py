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
recomputation runs every position again and sends them."""
from __future__ import annotations

import torch

from graphtap.courier.chunks import FINISH, HELD
from graphtap.courier.held import Ending, StepBatch, _sampled_by_request


def holds_outputs(spec, params, max_bytes: int) -> bool:
    """Whether a request's chunks are held (frontend and worker decide alike): it
    returns rows, the engine holds outputs, and no step-by-step stop check (stop strings,
    repetition detection) could finish it at a step graphtap cannot foresee."""
    if max_bytes <= 0 or params is None or not spec.captures_anything:
        return False
    return not (bool(params.stop) or params.repetition_detection is not None)


class HeldChunks:
    """One worker's held chunks, per request in step order, and what may finish each."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._ending: dict[str, Ending] = {}
        self._chunks: dict[str, list[dict[str, torch.Tensor]]] = {}
        self._bytes: dict[str, int] = {}
        # counters (stats): chunks kept, sends, and sends forced by the bound
        self.kept, self.sends, self.bound_sends = 0, 0, 0

    def add_request(self, req_id: str, ending: Ending) -> None:
        self.remove_request(req_id)
        self._ending[req_id] = ending

    def remove_request(self, req_id: str) -> None:
        self._ending.pop(req_id, None)
        self._chunks.pop(req_id, None)
        self._bytes.pop(req_id, None)

    def holds(self, req_id: str) -> bool:
        return req_id in self._ending

    def any_in(self, req_ids) -> bool:
        return bool(self._ending) and any(r in self._ending for r in req_ids)

    def stats(self) -> dict:
        return {"held_chunk_requests": len(self._ending),
                "held_chunk_bytes": sum(self._bytes.values()),
                "chunks_kept_total": self.kept, "sends_total": self.sends,
                "bound_sends_total": self.bound_sends}

    def step(self, chunks: dict[str, dict[str, torch.Tensor]], batch: StepBatch | None,
             step) -> dict[str, list[dict[str, torch.Tensor]]]:
        """The step's chunks in; what goes home now out (per request, its chunks in step
        order). `step`: the step's ModelRunnerOutput (sampled tokens); None, or no
        batch: every held request of the step goes."""
        out = {r: [c] for r, c in chunks.items() if r not in self._ending}
        batch_reqs = batch.req_ids if batch is not None else []
        held_here = [r for r in dict.fromkeys([*batch_reqs, *chunks]) if r in self._ending]
        if not held_here:
            return out
        for req in held_here:
            if req in chunks:
                chunk = chunks[req]
                self._chunks.setdefault(req, []).append(chunk)
                self.kept += 1
                self._bytes[req] = self._bytes.get(req, 0) + _kept_bytes(chunk)
        after = dict(zip(batch.req_ids, batch.computed_after.tolist())) if batch else {}
        due = self._due(held_here, chunks, after, step)
        self.sends += len(due)
        for req in due:
            sent = self._chunks.pop(req, [])
            self._bytes.pop(req, None)
            # the positions computed so far: the frontend checks the last send covers all
            sent.append({HELD: torch.tensor([after.get(req, 0)], dtype=torch.int64)})
            out[req] = sent
        return out

    def _due(self, reqs: list[str], chunks: dict, after: dict[str, int], step) -> list[str]:
        """`after`: the batch's tokens computed per request (empty: no batch)."""
        if not after or step is None:
            return reqs
        if sum(self._bytes.values()) > self.max_bytes:
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
