"""A step's split made after its tokens have left (patch 0008's HookPayload.settle).

vLLM's async output thread splits a step's host rows per request before it hands the
step's output to the scheduler, so every token of the step waited for the split: a
prefill step of 8 requests capturing k at every prompt position (8 MiB of rows) took
milliseconds, and a burst of 64 such requests reached its first tokens that much later
than idle ones at every step that admitted some of them. A step whose split may wait
(StepSnapshots._defers: no guard to evaluate, nothing held, no sink, no request the
frontend may finish on a stop string) now gives each request that wanted rows in it a
LaterPayload instead; the engine core's output thread settles them after it has sent
the step's message (split_hook_rows, settle_hook_rows), and the step's split runs
there, once, for all of them. A request that finishes in the step has its payload
settled before the step's message goes (a decoding request of the batch that wanted
no rows gets none, so its finish does not hold the step's tokens back); an in-process
engine (no output thread) settles at the finish
(payload.open_payload), and a worker in a process of its own when it pickles the
step's output (LaterPayload.__reduce__). A step none of whose requests has an output
yet (every one mid-prefill) is made at the next step (Unsettled)."""
from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Any, ClassVar

from vllm.v1.outputs import HookPayload

from graphtap.courier.shipped import EMPTY, StepIds, bundle, failed_split, marker, shippable


class LaterPayload(HookPayload, gc=True):
    """One request's payload of a deferred step: settle() makes it. Never encoded (its
    `split` is no message type): split_hook_rows settles it first. gc: it refers to
    the step, which the collector may have to see."""

    deferred: ClassVar[bool] = True
    req: str = ""
    split: Any = None  # the step's DeferredSplit
    made: Any = None  # what settle() made (the split hands each payload out once)

    def settle(self) -> HookPayload:
        if self.made is None:
            self.made = self.split.payload(self.req)
            self.split = None
        return self.made

    def ship(self) -> HookPayload:
        """What the engine core's output thread sends (patch 0008): the step whole or
        a marker where the engine ships its steps (courier/shipped.py), else settled."""
        made = self.made
        if made is None:
            made = self.made = self.split.ship(self.req)
            self.split = None
        return made

    def __reduce__(self):
        # A worker in a process of its own (vLLM's multiprocessing executor: TP > 1,
        # the CPU backend) pickles the step's output to the engine core: it settles
        # there and then, and the engine core gets the payload as the split made it.
        made = self.settle()
        return HookPayload, (made.inline, made.frames, made.finish)


class DeferredSplit:
    """A step's per-request split, made at the first settle (or by Unsettled) and shared
    by its requests' payloads, each handed out once (the output thread settles them one
    by one; a lock keeps two threads from making it twice)."""

    def __init__(self, snapshots, requests: set[str], ship=None):
        self._snapshots, self._requests = snapshots, requests
        self._lock = threading.Lock()
        self._made: dict[str, HookPayload] | None = None
        # where the step may travel whole (shipped.py): its id maker; then its id, once
        # its bundle has gone
        self._ship, self._shipped = ship, None

    def payloads(self) -> dict[str, LaterPayload]:
        return {req: LaterPayload(req=req, split=self) for req in self._requests}

    def make(self, timed: bool = True) -> None:
        """Splits the step, once. `timed`: in the engine's clock as split_later (not
        where it runs inside per_request, whose time already counts it: Unsettled)."""
        with self._lock:
            self._make_once(timed)

    def payload(self, req: str) -> HookPayload:
        with self._lock:
            if self._shipped is not None:  # its payload waits in the frontend
                return marker(self._shipped) if req in self._requests else EMPTY
            self._make_once(timed=True)
            return self._made.pop(req, EMPTY)

    def ship(self, req: str) -> HookPayload:
        """`req`'s payload as it leaves the engine core's process: the first one the
        step whole (its bundle), the others a marker of it, where the step may travel
        whole and nothing has split it yet; else as payload() makes it."""
        with self._lock:
            if self._shipped is None and self._made is None and self._ship is not None \
                    and shippable(self._snapshots.parts):
                with self._snapshots.clock.phase("ship"):
                    self._shipped = self._ship()
                    sent = bundle(self._shipped, self._snapshots.parts,
                                  sorted(self._requests))
                self._snapshots = None  # the bundle holds the host copies until sent
                return sent
        return self.payload(req)

    def _make_once(self, timed: bool) -> None:  # under the lock
        if self._made is None and self._shipped is None:
            with self._snapshots.clock.phase("split_later") if timed else nullcontext():
                self._made = self._make()
            self._snapshots = None  # the step's host copies go once split

    def _make(self) -> dict[str, HookPayload]:
        try:
            return self._snapshots.split_now()
        except Exception as e:  # on the engine core's output thread: it must not die
            return failed_split(self._requests, e)


class Unsettled:
    """One engine's deferred splits that no settle has made yet (EngineHooks owns it).
    The scheduler keeps a payload of a request whose prefill goes on in later steps
    until the request's next output: a step whose every request is such (a long prompt
    alone in the batch) would keep its pinned host copy that long. The next step's
    per_request makes the older ones that are still waiting, on vLLM's async output
    thread (where the split ran before): at most one step's copy stays pinned."""

    def __init__(self, ship: bool = False) -> None:
        self._waiting: list[DeferredSplit] = []
        # the engine's bundle ids where its deferred steps may travel whole to the
        # frontend (shipped.py: one frontend, an engine core of its own process)
        self.ship = StepIds() if ship else None

    def make_older(self) -> None:
        """Makes the splits of earlier steps that no settle has made."""
        waiting, self._waiting = self._waiting, []
        for split in waiting:
            split.make(timed=False)  # a no-op for those the output thread has made

    def add(self, split: DeferredSplit) -> DeferredSplit:
        self._waiting.append(split)
        return split
