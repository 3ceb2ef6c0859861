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
The frontend splits a bundle when it arrives (ShippedRows.arrived) and hands each
request its payload when its marker comes (most in the same message; one the engine
settled for a finishing request, in the message that finishes it)."""
from __future__ import annotations

import logging
import os
import threading
from itertools import count

import msgspec
import torch
from vllm.v1.outputs import HookPayload

from graphtap.courier.chunks import ERROR, OverflowKind, error_tensor
from graphtap.courier.payload import DTYPES, _NAMES, seal

logger = logging.getLogger(__name__)

BUNDLE, MARKER = b"\xc1gtB", b"\xc1gtM"
EMPTY = HookPayload()  # what the split gave a request that got a marker: nothing


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
    """The frontend's side: each request's payloads split from bundles whose markers
    have not come yet (per request, per step id). A request's entries go when its marker
    comes or when it is released (finished or aborted), so nothing stays behind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, dict[str, HookPayload]] = {}

    def arrived(self, request_id: str, payloads: list[HookPayload]) -> list[HookPayload]:
        """A request's payloads of a rows message (HookFrontend.rows_arrived), with a
        bundle split (every request's payload kept for its marker) and markers whose
        payload is here replaced by it."""
        if not any(is_shipped(p) for p in payloads):
            return payloads
        out = []
        for p in payloads:
            if p.inline[:len(BUNDLE)] == BUNDLE:
                p = self._split(p)
            out.append(self._resolve(request_id, p) if is_shipped(p) else p)
        return [p for p in out if p is not EMPTY]

    def resolve(self, request_id: str, payloads: list[HookPayload]) -> list[HookPayload]:
        """A finished request's payloads with every marker replaced by its payload; a
        marker whose payload never came becomes the error that says so."""
        if not any(is_shipped(p) for p in payloads):
            return payloads
        out = [self._resolve(request_id, p, final=True) if is_shipped(p) else p
               for p in payloads]
        return [p for p in out if p is not EMPTY]

    def release(self, request_id: str) -> None:
        with self._lock:
            self._waiting.pop(request_id, None)

    def waiting(self) -> int:
        """Payloads kept for markers not come yet (leak checks: 0 once all ended)."""
        with self._lock:
            return sum(len(v) for v in self._waiting.values())

    def _split(self, payload: HookPayload) -> HookPayload:
        meta = _BUNDLE.decode(memoryview(payload.inline)[len(BUNDLE):])
        try:
            made = split_bundle(meta, payload.frames)
        except Exception as e:  # in the output handler: fail the step's rows, not it
            logger.exception("graphtap: splitting a shipped step's hook outputs")
            failed = _failed(f"could not split a step's rows ({type(e).__name__}: {e})")
            made = dict.fromkeys(meta.requests, failed)
        with self._lock:
            for req in meta.requests:  # none where the split gave a request nothing
                self._waiting.setdefault(req, {})[meta.step] = made.get(req, EMPTY)
        return marker(meta.step)

    def _resolve(self, request_id: str, payload: HookPayload,
                 final: bool = False) -> HookPayload:
        step = marker_step(payload)
        with self._lock:
            mine = self._waiting.get(request_id)
            found = mine.pop(step, None) if mine else None
            if mine is not None and not mine:
                del self._waiting[request_id]
        if found is not None:
            return found
        return _failed("a step's shipped rows never reached this frontend") if final \
            else payload


def _failed(why: str) -> HookPayload:
    return seal({ERROR: error_tensor(f"hooks: graphtap {why}; please report it")})
