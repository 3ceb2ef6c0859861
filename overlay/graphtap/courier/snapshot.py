"""One step's labelled device rows on their way home: cloned on the main stream after the
forward, copied to the host on vLLM's output copy stream (a large step's rows on a
stream of their own, waited for where they are read), split per request once the copy
is done (vllm's HookStepOutput protocol).

Every row carries its label from the device (ops.tables.Label), and the step's own
batch maps slots to request ids, so attribution never comes from expected lengths
(EasySteer's bug). The per-request split is the one consumer today; a bulk sink (device
-> pinned -> disk) would be a second consumer of the same host rows and labels.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm.v1.outputs import HookPayload

from graphtap.courier.chunks import OVERFLOW, Overflow, OverflowKind
from graphtap.courier.later import DeferredSplit, Unsettled
from graphtap.courier.groups import group_keys, grouped_in_order
from graphtap.courier.pack import run_starts
from graphtap.courier.payload import seal, seal_values
from graphtap.courier.step_rows import StepRows
from graphtap.ops.tables import Label
from graphtap.profiling import HostClock, named

SLOT_COLUMN = int(Label.SLOT)
# A step with this many bytes of rows is split after its tokens have left (later.py);
# a smaller one's split (a few requests' last-prompt rows) costs less than the message
# of its own the rows then take
DEFER_BYTES = 64 << 10


class StepSnapshots:
    """The snapshots of one step (rows, patterns), handed to vLLM's courier as one."""

    def __init__(self, parts: list["LabelledStep"], guards: dict | None = None,
                 batch=None, hold=None, clock=None, inline: set[str] | None = None,
                 unsettled: Unsettled | None = None):
        self.parts = parts
        # the engine's deferred splits not yet made (later.py): older ones are made at
        # this step's per_request
        self.unsettled = unsettled if unsettled is not None else Unsettled()
        # requests whose values all travel inside the step's message, however large
        # (stop strings: payload.seal)
        self.inline = inline or ()
        self.guards = guards or {}  # req_id -> (GuardEntry, prompt_len) of the batch
        self.batch = batch  # courier.held.StepBatch, where a part or a chunk is held
        self.hold = hold  # courier.held_chunks.HeldChunks, where the engine holds chunks
        self.clock = clock if clock is not None else HostClock()  # the engine's (profiling.py)

    def release_device(self) -> None:  # nested in another: its parts release in per_request
        pass

    # What held_chunks.HeldChunks.step_snapshots asks of a step it may hold whole.
    def requests(self) -> set[str]:
        """The requests that wanted rows in the step (each part's count per slot, on the
        host after the copy): asked only where may_wait holds, every part then being a
        LabelledStep. A request of the batch that wanted none gets nothing from the
        split, so it is no part of a deferred or held step: a decoding request that
        finishes in a qk prefill step must not make that step's split run before the
        step's tokens leave (split_hook_rows settles a finishing request's payload in
        place; test_bench_delivery.py measures what that cost)."""
        return set().union(*(part.wanting() for part in self.parts))

    def may_wait(self) -> bool:
        """Whether the split may wait for a later step: not with a guard to evaluate
        (it may stop a request now), held probe rows (their holder decides per step) or
        rows for the sink (the writer takes them now)."""
        return not self.guards and all(
            isinstance(p, LabelledStep) and getattr(p, "held", None) is None and
            p.sink is None for p in self.parts)  # not a refusal (RequestErrors): it goes

    def release_parts(self) -> None:
        """The device clones go (the copy home has run); the host rows stay."""
        for part in self.parts:
            part.release_device()

    def nbytes(self) -> int:
        """Host bytes the step's copies keep alive."""
        return sum(t.untyped_storage().nbytes() for p in self.parts
                   for t in (p.rows, p.labels) if isinstance(t, torch.Tensor))

    # Named ranges: profile_capture.py reads where the courier's host time goes.
    def to_cpu_nonblocking(self) -> None:
        with named("graphtap.to_cpu"), self.clock.phase("to_cpu"):
            for part in self.parts:
                part.to_cpu_nonblocking()

    def per_request(self, step=None) -> dict[str, HookPayload]:
        """What each request of the step gets (vLLM's HookStepOutput): its chunk sealed
        as it travels (payload.py), or a payload settled after the step's tokens have
        left (courier/later.py), where the split may wait."""
        with self.clock.phase("per_request"):
            self.unsettled.make_older()
            requests = self._defers()
            if requests is not None:
                self.release_parts()  # the copy is done (after the copy event)
                return self.unsettled.add(
                    DeferredSplit(self, requests, self.unsettled.ship)).payloads()
            return self._per_request(step)

    def split_now(self) -> dict[str, HookPayload]:
        """A deferred step's payloads (DeferredSplit, on the engine core's output
        thread): nothing held, so no step output is needed."""
        return self._per_request(None)

    def _defers(self) -> set[str] | None:
        """The requests of a step whose split waits until its tokens have left: one
        with DEFER_BYTES of rows or more that may wait (no guard, held rows or sink),
        where the engine holds no chunks and no request may finish on a stop string
        (its values travel in the step's message: payload.seal); else None."""
        if self.hold is not None or not self.may_wait() or \
                sum(p.used_bytes() for p in self.parts) < DEFER_BYTES:
            return None
        requests = self.requests()
        return None if not requests or requests.intersection(self.inline) else requests

    def _per_request(self, step) -> dict[str, HookPayload]:
        direct = self._sealed() if self.hold is None and not self.guards else None
        if direct is not None:
            return direct
        # held chunks (held_chunks.py) go when their request may finish, several at once;
        # a step of held requests only may stay whole until then
        going = {req: (chunk,) for req, chunk in self.chunks(step).items()} \
            if self.hold is None else self.hold.step_snapshots(self, step)
        with named("graphtap.seal"):
            inline = self.inline
            return {req: seal(*sent, all_inline=req in inline) for req, sent in going.items()}

    def _sealed(self) -> dict[str, HookPayload] | None:
        """Each request's payload made from the parts' host copies without chunks of
        tensors (courier/direct.py), where every part can; None: the chunk way."""
        values = []
        for part in self.parts:
            found = part.sealed(self.inline) if isinstance(part, LabelledStep) and \
                getattr(part, "held", None) is None else None
            if found is None:
                return None
            values.append(found)
        with named("graphtap.per_request"):
            for part in self.parts:
                part.release_device()  # the copy is done (after the copy event)
            merged: dict[str, dict] = {}
            for found in values:
                for req, sealed in found.items():
                    merged.setdefault(req, {}).update(sealed)
            return {req: seal_values(*_frames_apart(sealed))
                    for req, sealed in merged.items() if sealed}

    def chunks(self, step=None) -> dict[str, dict[str, torch.Tensor]]:
        """Each request's outputs of the step, name -> tensor. `step`: the step's
        ModelRunnerOutput (sampled tokens), which says what held rows go home now
        (courier/held.py); without it every held request's do."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        with named("graphtap.per_request"):
            for part in self.parts:
                part.release_device()  # the copy is done (after the copy event)
                holder = getattr(part, "held", None)
                found = part.overflow() if holder is not None else part.per_request()
                for req, tensors in found.items():
                    out.setdefault(req, {}).update(tensors)
                if holder is not None:
                    for req, tensors in holder.step(*part.host_rows(), part.slot_to_req,
                                                    self.batch, step, self.guards).items():
                        out.setdefault(req, {}).update(tensors)
            if self.guards:
                from graphtap.courier.guard import apply_guards

                apply_guards(out, self.guards)
        return out


class LabelledStep:
    """One family's step rows: copied home, then split per request (`per_request`, by
    the family's subclass)."""

    # The event after the step's rows reached the host on a stream other than vLLM's
    # output copy stream (_rows_to_cpu), until something waits for it: vLLM records the
    # step's copy event on that stream after every copy queued there, so the step's
    # sampled tokens waited for megabytes of rows (a qk prefill step's 8 MiB, a sink
    # step's hundreds of MiB) that a deferred split (later.py) or the sink's writer reads
    # only after those tokens have left.
    rows_ready = None

    @property
    def rows(self) -> torch.Tensor:
        """The step's rows; on the host, once their copy has run (it waits for it)."""
        self._wait_rows()
        return self._rows

    def _wait_rows(self) -> None:
        if self.rows_ready is not None:
            self.rows_ready.synchronize()
            self.rows_ready = None

    @rows.setter
    def rows(self, rows: torch.Tensor) -> None:
        self._rows = rows

    def __init__(self, step: StepRows):
        self.rows, self.labels, self.count = step.rows, step.labels, step.count
        self.stream = step.stream
        self.slot_to_req, self.formats = step.slot_to_req, step.formats
        self.site_names, self.capacity = step.site_names, step.capacity
        self.overflow_kind = step.overflow_kind
        self.home = step.home
        self._head = step.head
        self._device = None
        self.sink = None  # engine.families.capture.SinkTap: rows that go to the sink
        self.tokens = None  # per row its input token id (sink steps only)

    def to_cpu_nonblocking(self) -> None:
        if self.home:
            return  # copied on the main stream (RowFamily.snapshot): vLLM's copy event
            # is recorded after its copy stream waited for the main stream
        # The device clones must stay referenced until the copy has run: the copy is
        # queued on the output copy stream, and a block freed now would go back to the
        # main stream's pool and be overwritten by the next step first (the garbage
        # counts and lost rows seen on the H200 before this). Released in per_request,
        # which runs after the copy event.
        head, self._head = self._head, None
        # (a head's count and labels are views: they hold its block)
        self._device = (self.rows, self.labels, self.count, self.tokens)
        # The rows last: queued before the labels and count, vLLM's copy event came only
        # once the rows were home, in 20 steps of 20; queued after them, it came before
        # the rows were home in 20 steps of 20 (check_staging.check_rows_stream, H100)
        if head is not None:
            self.count, self.labels = head.parts(head.block.to("cpu", non_blocking=True))
        else:
            self.labels = self.labels.to("cpu", non_blocking=True)
            self.count = self.count.to("cpu", non_blocking=True)
        if self.tokens is not None:
            self.tokens = self.tokens.to("cpu", non_blocking=True)
        self.rows = self._rows_to_cpu(self.rows)

    def _rows_to_cpu(self, rows: torch.Tensor) -> torch.Tensor:
        stream, host = self._rows_home(rows)
        if stream is None:
            return rows.to("cpu", non_blocking=True)
        stream.wait_stream(torch.cuda.current_stream())  # vLLM's copy stream: after
        # the clone and the step's sampled tokens, whose copies it queued first
        with torch.cuda.stream(stream):
            if host is None:
                host = rows.to("cpu", non_blocking=True)
            else:
                host.copy_(rows, non_blocking=True)
            self.rows_ready = torch.cuda.Event(blocking=True)  # sleeps, as vLLM's copy event
            self.rows_ready.record(stream)
        rows.record_stream(stream)  # the clone's block waits for this copy, not the
        # copy event after which per_request releases it
        return host

    def _rows_home(self, rows: torch.Tensor) -> tuple[object, torch.Tensor | None]:
        """The stream the step's rows go home on (None: vLLM's copy stream, with the
        rest) and the pinned block they go into (None: one made for them)."""
        return self.stream, None

    def release_device(self) -> None:
        self._device = None

    def used_rows(self) -> int:
        """Rows the step wrote that came home (the host's bound on the copy may be short:
        overflow())."""
        return min(int(self.count[0]), self._rows.shape[0])  # no wait for the rows

    def wanting(self) -> set[str]:
        """The requests that wanted rows in the step (the device's count per slot, as
        overflow() reads it): one with rows always wanted them."""
        wanted = self.count[1:].tolist()
        return {req for slot, req in self.slot_to_req.items() if wanted[slot] > 0}

    def used_bytes(self) -> int:
        """Host bytes of the rows the step wrote (after the copy)."""
        return self.used_rows() * self._rows.shape[1] * self._rows.element_size()

    def sealed(self, inline=()) -> dict[str, dict] | None:
        """Per request its payload values (payload.Inline, or a tensor that travels as
        a frame) made straight from the host copy, where the family can (CaptureStep);
        None: the chunk way. `inline`: requests whose values all travel inside the
        message."""
        return None

    def host_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The used rows' labels and values as host arrays of their own (the pinned
        copies go back to the allocator), for a held family (courier/held.py)."""
        if getattr(self, "_host", None) is None:
            used = self.used_rows()
            self._host = (self.labels[:used].numpy().copy(), self.rows[:used].numpy().copy())
        return self._host

    def per_request(self) -> dict[str, dict[str, torch.Tensor]]:
        return {**self._gathered(), **self.overflow()}  # the lost ones: their error

    def _gathered(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each request's rows of the step, by output name (the family's split)."""
        raise NotImplementedError

    def all_home(self, count: list[int]) -> bool:
        """Whether every unit the step's requests wanted got a row and the row came home
        (count: the step's counts as plain ints; a numpy reduction's code is cold once a
        step between forwards, benchmarks/cpu/burst_timeline.py)."""
        written = count[0]
        return written <= self._rows.shape[0] and written == sum(count) - written

    def overflow(self) -> dict[str, dict[str, torch.Tensor]]:
        """The requests that lost rows this step, each with the overflow as its result
        (never a partial one); empty when every row came home. The device counted the
        units each request slot wanted, gave rows to whole requests while they fitted,
        and labelled every row: a request with fewer labelled rows here than it wanted
        lost some (it did not fit, or the host's bound on the copy was short), and only
        such requests fail."""
        if self.all_home(self.count.tolist()):
            return {}  # every unit got a row and came home: the usual step
        written, wanted = int(self.count[0]), self.count[1:].numpy()
        home = min(written, self._rows.shape[0])
        slots = self.labels[:home, SLOT_COLUMN].numpy()
        kept = np.bincount(slots, minlength=len(wanted)) if home else np.zeros_like(wanted)
        short = written > self._rows.shape[0]
        lost = {}
        for slot, req in self.slot_to_req.items():
            if kept[slot] < wanted[slot]:
                kind = OverflowKind.HOST_BOUND if short else self.overflow_kind
                room = self._rows.shape[0] if short else self.capacity
                lost[req] = {OVERFLOW: Overflow(kind, int(wanted[slot]), room).to_tensor()}
        return lost

    def sorted_labels(self, order: tuple[int, ...],
                      keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The used rows' labels (those `keep` marks, or all) sorted by the columns
        `order` (most significant first), and the buffer rows they are (sorted i =
        buffer row perm[i]). Groups (the first two columns) may come in any order:
        spans() needs each one contiguous and sorted inside, which the device order
        usually already is."""
        used = self.used_rows()
        labels = self.labels[:used].numpy()
        rows = np.arange(used) if keep is None else np.flatnonzero(keep)
        if keep is not None:
            labels = labels[rows]
        if grouped_in_order(labels, order):
            return labels, rows
        perm = np.lexsort(tuple(labels[:, c] for c in reversed(order)))
        return labels[perm], rows[perm]

    def spans(self, labels: np.ndarray, perm: np.ndarray, slot_col: int, site_col: int):
        """Per (slot, site) of a live request, over sorted_labels(): (request id, slot,
        site, start, end, first, index), the group being labels[start:end]; index None
        where the device wrote the group in order (the usual case: a request's tokens
        are adjacent in the batch), its rows then being first, first + 1, ...; else
        the rows' indices in order."""
        if not len(labels):
            return
        keys = group_keys(labels[:, slot_col], labels[:, site_col])
        starts = run_starts(keys[1:] != keys[:-1])
        ends = np.append(starts[1:], len(labels))
        # A group is a plain slice when its rows sit in order in the buffer: no break
        # (a step other than +1 in perm) inside it. Vectorised: one pass per step, not
        # per group (a decode step of 64 requests x 3 sites has 192 one-row groups).
        breaks = np.concatenate(([0], np.cumsum(np.diff(perm) != 1)))
        in_order = (breaks[ends - 1] - breaks[starts]) == 0
        for start, end, slot, site, plain, first in zip(
                starts.tolist(), ends.tolist(), labels[starts, slot_col].tolist(),
                labels[starts, site_col].tolist(), in_order.tolist(), perm[starts].tolist()):
            req = self.slot_to_req.get(slot)
            if req is not None:
                yield req, slot, site, start, end, first, None if plain else perm[start:end]

    def groups(self, order: tuple[int, ...], slot_col: int, site_col: int):
        """(request id, slot, site, labels, rows) per group, rows sorted by `order`: a
        view of the pinned step copy where in order, else a gathered copy."""
        labels, perm = self.sorted_labels(order)
        for req, slot, site, start, end, first, index in self.spans(labels, perm, slot_col,
                                                                    site_col):
            rows = self.rows[first:first + end - start] if index is None else \
                self.rows[torch.from_numpy(index)]
            yield req, slot, site, labels[start:end], rows


def _frames_apart(values: dict) -> tuple[dict, dict]:
    """A request's sealed values as payload.seal_values takes them: Inline values, then
    the tensors that travel as frames, each in their order."""
    inline = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
    return inline, {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
