"""A step's split made after its tokens have left (patch 0008's HookPayload.settle).

vLLM's async output thread splits a step's host rows per request before it hands the
step's output to the scheduler, so every token of the step waited for the split: a
prefill step of 8 requests capturing k at every prompt position (8 MiB of rows) took
milliseconds, and a burst of 64 such requests reached its first tokens that much later
than idle ones at every step that admitted some of them. A step whose split may wait
(StepSnapshots.defers: no guard to evaluate, nothing held, no sink, no request the
frontend may finish on a stop string) now gives each of its requests a LaterPayload
instead; the engine core's output thread settles them after it has sent the step's
message (split_hook_rows, settle_hook_rows), and the step's split runs there, once, for
all of them. A request that finishes in the step has its payload settled before the
step's message goes; an in-process engine (no output thread) settles at the finish
(payload.open_payload), and a worker in a process of its own when it pickles the
step's output (LaterPayload.__reduce__)."""
from __future__ import annotations

import logging
import threading
from typing import Any, ClassVar

from vllm.v1.outputs import HookPayload

from graphtap.courier.chunks import ERROR, error_tensor
from graphtap.courier.payload import seal

logger = logging.getLogger(__name__)

EMPTY = HookPayload()  # a request of the step that got no rows in it


class LaterPayload(HookPayload, gc=True):
    """One request's payload of a deferred step: settle() makes it. Never encoded (its
    `split` is no message type): split_hook_rows settles it first. gc: it refers to
    the step, which the collector may have to see."""

    deferred: ClassVar[bool] = True
    req: str = ""
    split: Any = None  # the step's DeferredSplit

    def settle(self) -> HookPayload:
        return self.split.payload(self.req)

    def __reduce__(self):
        # A worker in a process of its own (vLLM's multiprocessing executor: TP > 1,
        # the CPU backend) pickles the step's output to the engine core: it settles
        # there and then, and the engine core gets the payload as the split made it.
        made = self.settle()
        return HookPayload, (made.inline, made.frames, made.finish)


class DeferredSplit:
    """A step's per-request split, made at the first settle and shared by its requests'
    payloads (the output thread settles them one by one; a lock keeps an in-process
    frontend's settle from making it twice)."""

    def __init__(self, snapshots, requests: set[str]):
        self._snapshots, self._requests = snapshots, requests
        self._lock = threading.Lock()
        self._made: dict[str, HookPayload] | None = None

    def payloads(self) -> dict[str, LaterPayload]:
        return {req: LaterPayload(req=req, split=self) for req in self._requests}

    def payload(self, req: str) -> HookPayload:
        with self._lock:
            if self._made is None:
                self._made = self._make()
                self._snapshots = None  # the step's host copies go once split
            return self._made.get(req, EMPTY)

    def _make(self) -> dict[str, HookPayload]:
        snapshots = self._snapshots
        try:
            with snapshots.clock.phase("split_later"):
                return snapshots.split_now()
        except Exception as e:  # on the engine core's output thread: it must not die
            logger.exception("graphtap: splitting a step's hook outputs")
            failed = seal({ERROR: error_tensor(
                f"hooks: graphtap could not split a step's rows ({type(e).__name__}: "
                f"{e}); please report it")})
            return {req: failed for req in self._requests}
