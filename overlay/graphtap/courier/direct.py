"""A small capture step sealed straight from the host copy: each request's payload
values (payload.Inline) cut from numpy views of the step's pinned rows, with no torch
call per request or per value.

Why: vLLM runs the worker's output path (the copy wait, this split, the seal) on an
async output thread beside the engine core's busy loop, which meanwhile schedules and
prepares the next step in Python. Every torch call releases the GIL, and a release lets
the loop keep it for up to a switch interval: on the H200 host the split and seal of a
prefill step's last-prompt rows cost several times what they cost on a quiet thread
(benchmarks/cpu/test_bench_delivery.py test_split_and_seal_beside_a_busy_thread), and a
burst's first tokens wait for them.

The payloads are byte for byte what payload.seal makes of CaptureStep._split_small's
chunks (tests/test_courier_direct.py); a step this path cannot take whole (rows lost, a
cast, heads that are not one run, a value large enough to travel as a frame) returns
None and goes the chunk way. A larger step whose requests all ask the same (a burst's
decode step) is cut in array passes instead of the walk (seal_uniform, on the layout
uniform.py finds for the tensor split too)."""
from __future__ import annotations

from array import array

import numpy as np
import torch

from graphtap.courier.chunks import positions_key
from graphtap.courier.pack import SOLO_BYTES, column_span, pack_format, pack_key, row_bytes
from graphtap.courier.payload import _NAMES, INLINE_BYTES, Inline
from graphtap.courier.uniform import Uniform, uniform_formats


def plain_groups(labels: np.ndarray, formats: dict, site_names: dict[int, str],
                 slot_to_req: dict[int, str]):
    """The plain-Python walk of a small step that CaptureStep._split_small and the direct
    seal share: per value of a request's chunk, in the chunk's order, (request id, key,
    format, buffer rows, index). Per request (by slot), each site with SOLO_BYTES of
    rows or more on its own (key: its name; index: its positions), the others packed
    per output format in site order (key: pack.pack_key; index: each site's row count,
    then the positions), every group's rows in position order. `labels`: the used rows'
    (slot, site, position)."""
    groups: dict[int, dict[int, list[tuple[int, int]]]] = {}
    for row, (slot, site, pos) in enumerate(labels.tolist()):
        if slot in slot_to_req:
            groups.setdefault(slot, {}).setdefault(site, []).append((pos, row))
    for slot in sorted(groups):
        req = slot_to_req[slot]
        packs: dict[tuple, list[tuple[int, list[tuple[int, int]]]]] = {}
        for site in sorted(groups[slot]):
            found = sorted(groups[slot][site])
            fmt = pack_format(formats[slot][site])
            if len(found) * row_bytes(fmt) < SOLO_BYTES:
                packs.setdefault(fmt, []).append((site, found))
                continue
            yield req, site_names[site], fmt, [r for _, r in found], [p for p, _ in found]
        for fmt, members in packs.items():
            yield (req, pack_key([site_names[site] for site, _ in members]), fmt,
                   [r for _, found in members for _, r in found],
                   [len(found) for _, found in members] +
                   [p for _, found in members for p, _ in found])


def seal_small(labels: np.ndarray, raw: np.ndarray, dtype: torch.dtype, formats: dict,
               site_names: dict[int, str],
               slot_to_req: dict[int, str]) -> dict[str, dict[str, Inline]] | None:
    """Per request its values as seal() of _split_small's chunk would hold them, in the
    same order (plain_groups). `raw`: the step copy's rows as bytes ([rows, columns x
    itemsize] uint8); `dtype`: the rows' dtype."""
    cut = _Cutter(raw, dtype)
    out: dict[str, dict[str, Inline]] = {}
    for req, key, fmt, rows, index in plain_groups(labels, formats, site_names,
                                                   slot_to_req):
        values = cut(fmt, rows)
        if values is None:
            return None
        chunk = out.setdefault(req, {})
        chunk[key], chunk[positions_key(key)] = values, _ints(index)
    return out


def seal_uniform(layout: Uniform, raw: np.ndarray,
                 dtype: torch.dtype) -> dict[str, dict[str, Inline]] | None:
    """seal_small's result for a step whose requests all ask the same (uniform.py's
    layout: the prefill and decode steps of a burst of one spec), in array passes, not
    a Python pass per (request, site): one copy of the rows, each request's values
    slices of it and of the layout's index. None where a value would be a cast or
    travel as a frame."""
    span = _Cutter(raw, dtype).span(layout.fmt)
    per = layout.per
    if span is None or per * (span[1] - span[0]) >= INLINE_BYTES:
        return None
    lo, hi, tail = span
    data = raw[layout.perm, lo:hi].reshape(len(layout.ids), -1)  # one copy, request-major
    at, name = positions_key(layout.key), _NAMES[dtype]
    shape, ints = (per, *tail), (layout.index.shape[1],)
    return {req: {layout.key: Inline(name, shape, memoryview(data[r])),
                  at: Inline("int64", ints, memoryview(layout.index[r]))}
            for r, req in enumerate(layout.ids)}


def seal_request_major(step, labels: np.ndarray, perm: np.ndarray, cols: tuple[int, int, int],
                       raw: np.ndarray, dtype: torch.dtype, inline=()
                       ) -> dict[str, dict[str, Inline | torch.Tensor]] | None:
    """Per request its values as seal() of split_uniform's chunk would hold them, in
    the same order, for a step whose requests all ask the same however large (a qk
    burst's prefill steps: k rows at every prompt position): per output format one
    copy of every request's rows, each value an Inline cut from a numpy view of it or,
    from INLINE_BYTES on, a frame: a tensor view of it (torch calls per format, none per
    request). `inline`: requests whose values all travel inside the message
    (payload.seal's all_inline). None where split_uniform would be or a format is a
    cast or heads in runs (_Cutter): the chunk way."""
    found = uniform_formats(step, labels, perm, cols)
    if found is None:
        return None
    ids, plans = found
    cut = _Cutter(raw, dtype)
    spans = [cut.span(p.fmt) for p in plans]
    if None in spans:
        return None
    out: dict[str, dict] = {req: {} for req in ids}
    for p, (lo, hi, tail) in zip(plans, spans):
        width, keys = hi - lo, ([p.key] if p.key else []) + p.names
        # one copy, request-major, out of the pinned buffer: index_select releases the
        # GIL for it, and copies words of the dtype's width at twice the pace of bytes
        # (numpy's fancy indexing was slower still)
        src = step.rows.view(_WORDS[cut.size])[:, lo // cut.size:hi // cut.size]
        copied = torch.index_select(src, 0, torch.from_numpy(p.rows))
        edges = np.cumsum([0] + p.sizes).tolist()
        total, flat = edges[-1], memoryview(copied.numpy().reshape(-1)).cast("B")
        frames = copied.view(dtype).view(-1, *tail).split(p.sizes * len(ids)) \
            if max(p.sizes) * width >= INLINE_BYTES else None
        at = memoryview(np.ascontiguousarray(p.positions).reshape(-1))
        index = memoryview(p.index.reshape(-1)) if p.key else None
        for i, req in enumerate(ids):
            chunk, base = out[req], i * total
            for k, key in enumerate(keys):
                a, b = base + edges[k], base + edges[k + 1]
                if frames is not None and (b - a) * width >= INLINE_BYTES and \
                        req not in inline:
                    chunk[key] = frames[i * len(keys) + k]
                else:
                    chunk[key] = Inline(cut.name, (b - a, *tail), flat[a * width:b * width])
                if k == 0 and p.key:
                    n = p.index.shape[1]
                    chunk[positions_key(key)] = Inline("int64", (n,), index[i * n:(i + 1) * n])
                else:
                    chunk[positions_key(key)] = Inline("int64", (b - a,), at[a:b])
    return out


class _Cutter:
    """Rows of the step copy in an output format, as Inline values (the columns and
    shapes of CaptureStep._gather: pack.column_span); None for what only the tensor path
    does."""

    def __init__(self, raw: np.ndarray, dtype: torch.dtype):
        self.raw, self.dtype, self.name = raw, dtype, _NAMES.get(dtype)
        self.size = dtype.itemsize
        self.columns = raw.shape[1] // self.size
        self._spans: dict[tuple, tuple | None] = {}
        self._flat: memoryview | None = None  # raw's bytes, made at the first cut

    def __call__(self, fmt, rows: list[int]) -> Inline | None:
        span = self.span(fmt)
        if span is None:
            return None
        lo, hi, tail = span
        if len(rows) * (hi - lo) >= INLINE_BYTES:
            return None  # a frame of its own: a tensor
        # Slices of one flat view of the host copy, joined: no numpy indexing per
        # request. In the engine this runs once a step between forwards, its code cold,
        # and each numpy call then costs tens of microseconds, not one
        # (benchmarks/cpu/burst_timeline.py).
        flat, stride = self._flat, self.raw.shape[1]
        if flat is None:
            flat = self._flat = memoryview(self.raw).cast("B")
        data = flat[rows[0] * stride + lo:rows[0] * stride + hi] if len(rows) == 1 else \
            b"".join([flat[r * stride + lo:r * stride + hi] for r in rows])
        return Inline(self.name, (len(rows), *tail), data)

    def span(self, fmt) -> tuple[int, int, tuple[int, ...]] | None:
        """(first byte, end byte, shape after the row count) of a format's columns; None
        for what only the tensor path does."""
        span = self._spans.get(fmt, False)
        if span is False:
            span = self._spans[fmt] = self._span(fmt)
        return span

    def _span(self, fmt) -> tuple[int, int, tuple[int, ...]] | None:
        if fmt.dtype != self.dtype or self.name is None:
            return None  # a cast
        lo, hi, cut = column_span(fmt, self.columns)
        if cut or hi > self.columns:
            return None  # heads in runs (_cut's copies), or columns the copy lacks
        head_dim = fmt.head_dim
        tail = ((hi - lo) // head_dim, head_dim) if head_dim else (hi - lo,)
        return lo * self.size, hi * self.size, tail


# a dtype's values as integers of its width
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _ints(values: list[int]) -> Inline:
    return Inline("int64", (len(values),), memoryview(array("q", values)))  # numpy's int64
