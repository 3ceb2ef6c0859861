"""The courier's host half: a step's labelled device rows (captures, attention patterns)
cloned on the main stream, copied home on the output copy stream, and split per request
once the copy is done.

Every row carries its (request slot, site, position) label from the device, and the step's
own batch maps slots to request ids, so attribution never comes from expected lengths
(EasySteer's bug).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

# value: [rows wanted, capacity, kind]; kind 0 capture rows, 1 pattern rows, 2 the host's
# row bound was short (a graphtap bug: reported, never a silent loss)
OVERFLOW_KEY = "graphtap:overflow"
BOUND_SHORT = 2


class StepSnapshots:
    """The snapshots of one step (rows, patterns), handed to the courier as one."""

    def __init__(self, parts):
        self.parts = parts

    # Named ranges: profile_capture.py reads where the courier's host time goes.
    def to_cpu_nonblocking(self) -> None:
        with torch.profiler.record_function("graphtap.to_cpu"):
            for part in self.parts:
                part.to_cpu_nonblocking()

    def per_request(self) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        with torch.profiler.record_function("graphtap.per_request"):
            for part in self.parts:
                part.release_device()  # the copy is done (after the copy event)
                for req, tensors in part.per_request().items():
                    out.setdefault(req, {}).update(tensors)
        return out


class LabelledSnapshot:
    """One step's labelled device rows (captures or patterns): cloned on the main stream,
    copied to the host on the output copy stream, split per request once the copy is
    done (HookManager.collect). Subclasses say how labels sort and what a group becomes."""

    OVERFLOW_KIND = 0  # third field of the overflow flag: 0 capture rows, 1 pattern rows

    def __init__(self, rows, labels, count, slot_to_req, formats, site_names, capacity):
        self.rows, self.labels, self.count = rows, labels, count
        self.slot_to_req, self.formats, self.site_names = slot_to_req, formats, site_names
        self.capacity = capacity

    def to_cpu_nonblocking(self) -> None:
        # The device clones must stay referenced until the copy has run: the copy is
        # queued on the output copy stream, and a block freed now would go back to the
        # main stream's pool and be overwritten by the next step first (the garbage
        # counts and lost rows seen on the H200 before this). Released in per_request,
        # which runs after the copy event.
        self._device = (self.rows, self.labels, self.count)
        self.rows = self.rows.to("cpu", non_blocking=True)
        self.labels = self.labels.to("cpu", non_blocking=True)
        self.count = self.count.to("cpu", non_blocking=True)

    def release_device(self) -> None:
        self._device = None

    def overflow(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """Rows were lost: say so for every capturing request (never a partial result)."""
        wanted, room = int(self.count[0]), min(self.capacity, self.rows.shape[0])
        if wanted <= room:
            return None
        kind = self.OVERFLOW_KIND if wanted > self.capacity else BOUND_SHORT
        flag = torch.tensor([wanted, room, kind], dtype=torch.int64)
        return {req: {OVERFLOW_KEY: flag} for req in self.slot_to_req.values()}

    def sorted_labels(self, order: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """The used rows' labels sorted by the columns `order` (most significant
        first), and the permutation that sorts them (sorted i = buffer row perm[i]).
        Groups (the first two columns) may come in any order: spans() needs each one
        contiguous and sorted inside, which the device order usually already is."""
        used = min(int(self.count[0]), self.rows.shape[0])
        labels = self.labels[:used].numpy()
        if len(order) == 3 and _grouped_in_order(labels, order):
            return labels, np.arange(used)
        perm = np.lexsort(tuple(labels[:, c] for c in reversed(order)))
        return labels[perm], perm

    def spans(self, labels: np.ndarray, perm: np.ndarray, slot_col: int, site_col: int):
        """Per (slot, site) of a live request, over sorted_labels(): (request id, slot,
        site, start, end, first, index), the group being labels[start:end]; index None
        where the device wrote the group in order (the usual case: a request's tokens
        are adjacent in the batch), its rows then being first, first + 1, ...; else
        the rows' indices in order."""
        if not len(labels):
            return
        keys = _group_keys(labels[:, slot_col], labels[:, site_col])
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        ends = np.r_[starts[1:], len(labels)]
        # A group is a plain slice when its rows sit in order in the buffer: no break
        # (a step other than +1 in perm) inside it. Vectorised: one pass per step, not
        # per group (a decode step of 64 requests x 3 sites has 192 one-row groups).
        breaks = np.r_[0, np.cumsum(np.diff(perm) != 1)]
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


class CaptureSnapshot(LabelledSnapshot):
    """Labels: (slot, site, position) per row."""

    def per_request(self) -> dict[str, dict[str, torch.Tensor]]:
        lost = self.overflow()
        if lost is not None:
            return lost
        # Copies out of the pinned step buffer (a view would keep it from going back to
        # the caching host allocator) of the bytes returned only, in few large copies:
        # one per (site, output format) over the rows of its in-order groups, each
        # group then a view of it. A row spans the widest configured site (Llama-3-8B:
        # 4096 columns) where a k row of 4 heads uses 512; copying whole rows made a
        # qk prefill step of 8 x 256 tokens cost 12 ms here, 67 MB moved for 8. And
        # per-group copies (or even per-group tensors from numpy) add up: a decode step
        # of 64 requests x 3 sites has 192 groups, and the H200 host was ~50 us per copy.
        labels, perm = self.sorted_labels((0, 1, 2))
        groups = list(self.spans(labels, perm, 0, 1))
        by_block: dict[tuple, list[tuple[int, int, int]]] = {}  # key -> (first, rows, group)
        for g, (_, slot, site, start, end, first, index) in enumerate(groups):
            if index is None:
                by_block.setdefault((site, self.formats[(slot, site)]), []).append(
                    (first, end - start, g))
        data: dict[int, torch.Tensor] = {}
        for key, members in by_block.items():
            members.sort()
            lo, hi = members[0][0], max(first + n for first, n, _ in members)
            data.update(_split(self._cut(self.rows[lo:hi], key[1]), lo, members))
        # .copy(): numpy calls a 1-element column contiguous and keeps its stride of 3,
        # which vLLM's tensor serialiser then refuses (a step of one captured row).
        positions = _split(torch.from_numpy(labels[:, 2].copy()), 0,
                           [(start, end - start, g) for g, (*_, start, end, _, _)
                            in enumerate(groups)])
        out: dict[str, dict[str, torch.Tensor]] = {}
        for g, (req, slot, site, start, end, first, index) in enumerate(groups):
            rows = data[g] if index is None else \
                self._cut(self.rows[torch.from_numpy(index)], self.formats[(slot, site)])
            name = self.site_names[site]
            out.setdefault(req, {})[name] = rows
            out[req][f"{name}@positions"] = positions[g]
        return out

    @staticmethod
    def _cut(rows: torch.Tensor, fmt: tuple) -> torch.Tensor:
        """Rows in an output format, as a new contiguous tensor: [rows, width], or for
        attention sites [rows, heads, head_dim] of the chosen heads."""
        dtype, width, heads, head_dim = fmt
        data = rows[:, :width]
        if head_dim:  # a step's rows narrowed to another site's columns may end mid-head
            data = data[:, :data.shape[1] // head_dim * head_dim]
            data = data.reshape(len(rows), -1, head_dim)
            if heads is not None:  # the copy takes the chosen heads only
                # Runs of adjacent heads as slice copies: advanced indexing (aten::index)
                # was the top host op of a qk prefill step on the H200 host, and 11x
                # slower here than copying the same 4 adjacent heads as one slice.
                out = torch.empty((len(rows), len(heads), head_dim), dtype=dtype)
                for dst, src, n in _head_runs(heads):
                    out[:, dst:dst + n].copy_(data[:, src:src + n])
                return out
        return data.to(dtype, copy=True).contiguous()


def columns(fmt: tuple) -> int:
    """Buffer columns an output format reads: its site's width, or with chosen heads up
    to the last of them (rows hold every head in order; _cut takes the chosen ones)."""
    _, width, heads, head_dim = fmt
    return width if heads is None else (max(heads) + 1) * head_dim


def _group_keys(slot: np.ndarray, site: np.ndarray) -> np.ndarray:
    """One int64 per (slot, site) pair (slots and sites stay far below the factor)."""
    return slot.astype(np.int64) * 1_000_003 + site


def _grouped_in_order(labels: np.ndarray, order: tuple[int, int, int]) -> bool:
    """Whether each (order[0], order[1]) group of the rows is one contiguous run with
    order[2] non-decreasing inside it: the usual capture step, whose rows the device
    writes site-major with each request's tokens adjacent and in position order. Checked
    in a few O(n) passes instead of sorting (lexsort of a qk prefill step's 8k labels
    was a quarter of its split here)."""
    if len(labels) < 2:
        return True
    a, b, c = (labels[:, k] for k in order)
    same = (a[1:] == a[:-1]) & (b[1:] == b[:-1])
    if not np.all(~same | (c[1:] >= c[:-1])):
        return False
    starts = np.flatnonzero(np.r_[True, ~same])
    keys = _group_keys(a[starts], b[starts])
    return len(np.unique(keys)) == len(keys)  # no group split over two runs


@functools.lru_cache(maxsize=256)
def _head_runs(heads: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """(output index, source head, count) per run of consecutive heads, in the order
    asked: (0, 1, 2, 3) is one run, (5, 2, 3) two."""
    runs: list[list[int]] = []
    for i, h in enumerate(heads):
        if runs and h == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([i, h, 1])
    return tuple(tuple(r) for r in runs)


def _split(t: torch.Tensor, lo: int, members: list[tuple[int, int, int]]) -> dict:
    """Views of t's rows: {key: t[first - lo:first - lo + n]} for (first, n, key) in
    members (sorted by first, not overlapping), made by one split call (a Python slice
    per group cost ~1.5 us each here: 192 groups per decode step of 64 requests x 3
    sites); the sizes include the gaps between members."""
    sizes, keys, cursor = [], [], lo
    for first, n, key in members:
        if first > cursor:
            sizes.append(first - cursor)
            keys.append(None)
        sizes.append(n)
        keys.append(key)
        cursor = first + n
    if cursor - lo < t.shape[0]:
        sizes.append(t.shape[0] - (cursor - lo))
        keys.append(None)
    return {k: part for k, part in zip(keys, t.split(sizes)) if k is not None}
