"""A deferred step shipped whole: its host rows, labels and counts go to the frontend
unsplit, and the frontend splits them there (patch 0008: HookPayload.ship,
HookFrontend.rows_arrived).

Why: the deferred split (later.py) ran on the engine core's output thread, beside the
busy loop that schedules and prepares the next step. Each of its torch and numpy calls
releases the GIL, and each release is a hand-over: a qk prefill step's split cost the
loop about twice its own time (benchmarks/cpu/test_bench_busy_loop.py), and on the H100
a qk burst's steps ran slower while it did. The frontend's process has a GIL of its
own, and the step's message with its tokens is handled before the rows' message.

The step's first shipped payload (the bundle) carries the step: its parts' rows,
labels and counts as frames, and what the split needs besides (slots to requests,
formats, site names, capacity) inside the message; every other request of the step gets
a marker, naming the bundle. Both begin with a byte msgpack never uses (0xc1), so a
payload's first byte tells them apart from payloads sealed the usual way (payload.py).
The frontend starts a bundle's split when it arrives (ShippedRows.arrived), on a thread
of its own, and hands each request its payloads when it finishes."""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import count
from typing import Callable

import msgspec
from vllm.v1.outputs import HookPayload

from graphtap.courier.chunks import ERROR, FINISH, OverflowKind, error_tensor
from graphtap.courier.pack import unpack
from graphtap.courier.payload import DTYPES, _NAMES, open_chunks, own, seal
from graphtap.profiling import HostClock

logger = logging.getLogger(__name__)

BUNDLE, MARKER = b"\xc1gtB", b"\xc1gtM"
EMPTY = HookPayload()  # a request the split gave nothing (none is handed a payload so)


class _Format(msgspec.Struct, array_like=True, gc=False):
    dtype: str
    width: int
    heads: tuple[int, ...] | None
    head_dim: int


class _Part(msgspec.Struct, array_like=True, gc=False):
    """One CaptureStep of the step, but for its tensors (the bundle's frames)."""

    slot_to_req: dict[int, str]
    layouts: list[dict[int, _Format]]  # distinct layouts (a burst of one spec: one)
    slot_layout: dict[int, int]  # slot -> its layout's index
    site_names: dict[int, str]
    capacity: int
    overflow_kind: int


class _Bundle(msgspec.Struct, array_like=True, gc=False):
    step: str  # the bundle's id, unique per engine and process
    requests: list[str]  # those that get a marker (the carrier included)
    parts: list[_Part]


_ENC, _BUNDLE, _MARKER = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(_Bundle), \
    msgspec.msgpack.Decoder(str)


def shippable(parts) -> bool:
    """Whether a deferred step's parts can travel whole: plain capture steps (no sink,
    nothing held: may_wait) whose formats are row formats, their rows in a dtype a
    payload may carry."""
    from graphtap.courier.rows import CaptureStep, RowFormat

    return bool(parts) and all(
        type(p) is CaptureStep and p.rows.dtype in _NAMES and p.rows.is_contiguous() and
        all(isinstance(f, RowFormat) for layout in p.formats.values()
            for f in layout.values()) for p in parts)


class StepIds:
    """Bundle ids of one engine: a random prefix (engines of several processes may
    send to one frontend) and a counter."""

    def __init__(self) -> None:
        self._prefix, self._next = os.urandom(6).hex(), count()

    def __call__(self) -> str:
        return f"{self._prefix}-{next(self._next)}"


def bundle(step: str, parts, requests: list[str]) -> HookPayload:
    """The payload that carries a step's parts whole (their used rows only)."""
    metas, frames = [], {}
    for i, p in enumerate(parts):
        used = p.used_rows()
        frames[f"{i}.rows"], frames[f"{i}.labels"] = p.rows[:used], p.labels[:used]
        frames[f"{i}.count"] = p.count
        layouts, slot_layout, seen = [], {}, {}
        for slot, layout in p.formats.items():
            at = seen.get(id(layout))
            if at is None:
                at = seen[id(layout)] = len(layouts)
                layouts.append({site: _Format(_NAMES[f.dtype], f.width, f.heads, f.head_dim)
                                for site, f in layout.items()})
            slot_layout[slot] = at
        metas.append(_Part(p.slot_to_req, layouts, slot_layout, p.site_names, p.capacity,
                           int(p.overflow_kind)))
    return HookPayload(BUNDLE + _ENC.encode(_Bundle(step, requests, metas)), frames)


def marker(step: str) -> HookPayload:
    return HookPayload(MARKER + _ENC.encode(step))


def is_shipped(payload: HookPayload) -> bool:
    return payload.inline[:1] == b"\xc1"


def _is_bundle(payload: HookPayload) -> bool:
    return payload.inline[:len(BUNDLE)] == BUNDLE


def split_bundle(meta: _Bundle, frames: dict) -> dict[str, HookPayload]:
    """Each request's payload: the step's split as the engine would have made it
    (StepSnapshots.split_now), from a bundle's parts."""
    from graphtap.courier.rows import CaptureStep, RowFormat
    from graphtap.courier.snapshot import StepRows, StepSnapshots

    parts = []
    for i, p in enumerate(meta.parts):
        layouts = [{site: RowFormat(DTYPES[f.dtype], f.width, f.heads, f.head_dim)
                    for site, f in layout.items()} for layout in p.layouts]
        parts.append(CaptureStep(StepRows(
            frames[f"{i}.rows"], frames[f"{i}.labels"], frames[f"{i}.count"], p.slot_to_req,
            {slot: layouts[at] for slot, at in p.slot_layout.items()}, p.site_names,
            p.capacity, OverflowKind(p.overflow_kind), home=True)))
    return StepSnapshots(parts).split_now()


def marker_step(payload: HookPayload) -> str:
    return _MARKER.decode(memoryview(payload.inline)[len(MARKER):])


class ShippedRows:
    """The frontend's side: a bundle is split on a thread of its own as it arrives (the
    output handler goes on delivering tokens: split there, a qk burst's steps delayed
    its later tokens by some 10 ms end to end on the H100), and each request's markers
    are replaced by its payloads when it finishes (per request, per step id, the
    split's result). A request's entries go when it finishes or is released
    (finished or aborted), so nothing stays behind."""

    def __init__(self, live: Callable[[str], bool] | None = None,
                 clock: HostClock | None = None) -> None:
        self._lock = threading.Lock()
        # the frontend's: the output handler's phase "arrived", the split thread's "split"
        self.clock = clock if clock is not None else HostClock()
        self._waiting: dict[str, dict[str, Future]] = {}
        # whether a request may still finish here: a bundle may come after some of its
        # step's requests were aborted, and what it keeps for them would stay forever
        self._live = live
        self._pool: ThreadPoolExecutor | None = None  # made at the first bundle

    def arrived(self, request_id: str, payloads: list[HookPayload]) -> list[HookPayload]:
        """A request's payloads of a rows message (HookFrontend.rows_arrived): a bundle
        becomes its marker, its split started for every request of its step."""
        if not any(map(_is_bundle, payloads)):
            return payloads
        return [self._split(p) if _is_bundle(p) else p for p in payloads]

    def resolve(self, request_id: str, payloads: list[HookPayload]) -> list[HookPayload]:
        """A finished request's payloads with every marker replaced by its payload (its
        step's split waited for where not made yet); a marker whose bundle never came
        becomes the error that says so."""
        if not any(is_shipped(p) for p in payloads):
            return payloads
        with self._lock:
            mine = self._waiting.pop(request_id, {})
        out = []
        for p in payloads:
            if is_shipped(p):
                made = mine.get(marker_step(p))
                p = _failed("a step's shipped rows never reached this frontend") \
                    if made is None else made.result().get(request_id, EMPTY)
            if p is not EMPTY:
                out.append(p)
        return out

    def release(self, request_id: str) -> None:
        with self._lock:
            self._waiting.pop(request_id, None)

    def waiting(self) -> int:
        """Steps' splits kept for requests not finished (leak checks: 0 once all ended)."""
        with self._lock:
            return sum(len(v) for v in self._waiting.values())

    def _split(self, payload: HookPayload) -> HookPayload:
        with self.clock.phase("arrived"):
            try:
                meta = _BUNDLE.decode(memoryview(payload.inline)[len(BUNDLE):])
            except msgspec.DecodeError as e:  # in the output handler, which must not die:
                # the carrier's hooks fail here, the others' at their markers (never came)
                logger.exception("graphtap: a shipped step's bundle that does not decode")
                return _failed(f"could not read a step's shipped rows ({e})")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="graphtap-split")
            made = self._pool.submit(_made, meta, payload.frames, self.clock)
            with self._lock:
                for req in meta.requests:
                    if self._live is None or self._live(req):
                        self._waiting.setdefault(req, {})[meta.step] = made
            return marker(meta.step)


def _made(meta: _Bundle, frames: dict, clock: HostClock) -> dict[str, HookPayload]:
    with clock.phase("split"):
        try:
            return {req: _owned(p) for req, p in split_bundle(meta, frames).items()}
        except Exception as e:  # on the frontend's split thread
            return failed_split(meta.requests, e)


def _owned(payload: HookPayload) -> HookPayload:
    """The payload opened here: its values unpacked per site, each in storage of its
    own. The split leaves them views of one buffer of the whole step (or of the
    message's bytes), which the request's outputs must not keep alive: the finish
    (payload.own) copied each request's rows out of it, and unpacked and decoded
    them, on the frontend's output handler, where every token of that message waited
    (a qk request's 1 MiB, 8 of them finishing at once in a burst). Here, on the split's
    thread, the copies hold no GIL; the finish then keeps the values as they are."""
    chunks = open_chunks(payload)
    if len(chunks) != 1 or FINISH in chunks[0]:  # one chunk a step, nothing held: kept
        return payload
    values = unpack(chunks[0])
    # a decoding request's few rows a site stay views of its own small pack: a copy
    # each was about 1000 copies a qk step (benchmarks/cpu/test_bench_delivery.py)
    within = sum(t.nbytes for t in values.values())
    return HookPayload(frames={k: own(t, within) for k, t in values.items()})


def failed_split(requests, e: Exception) -> dict[str, HookPayload]:
    """What each request of a step whose split raised gets: the error, with the reason
    (the split's thread, the engine core's output thread or the frontend's, must not
    die of it)."""
    logger.exception("graphtap: splitting a step's hook outputs")
    failed = _failed(f"could not split a step's rows ({type(e).__name__}: {e})")
    return dict.fromkeys(requests, failed)


def _failed(why: str) -> HookPayload:
    return seal({ERROR: error_tensor(f"hooks: graphtap {why}; please report it")})
