"""The courier's split of a capture step: each request's rows per site, in the format it
asked for (dtype, chosen heads), as tensors of their own (never views of the pinned step
buffer, which would keep it from going back to the caching host allocator)."""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from graphtap.courier.chunks import positions_key
from graphtap.courier.snapshot import LabelledStep
from graphtap.ops.tables import Label

# plain ints: numpy indexes with them on every step
ORDER = (int(Label.SLOT), int(Label.SITE), int(Label.POSITION))
SLOT, SITE, POSITION = ORDER
HOST_LABELS = len(ORDER)  # label columns a capture step copies home


class RowFormat(NamedTuple):
    """How a request gets one site's rows back."""

    dtype: torch.dtype
    width: int  # the site's row width (hidden size, or heads x head_dim)
    heads: tuple[int, ...] | None  # chosen heads (attention sites); None: the whole row
    head_dim: int  # 0 for residual sites


class CaptureStep(LabelledStep):
    """A capture step; labels (slot, site, position) per row."""

    def _gathered(self) -> dict[str, dict[str, torch.Tensor]]:
        # Copies out of the pinned step buffer (a view would keep it from going back to
        # the caching host allocator) of the bytes returned only, in few large copies:
        # one per (site, output format) over the rows of its in-order groups, each
        # group then a view of it. A row spans the widest configured site (Llama-3-8B:
        # 4096 columns) where a k row of 4 heads uses 512; copying whole rows made a
        # qk prefill step of 8 x 256 tokens cost 12 ms here, 67 MB moved for 8. And
        # per-group copies (or even per-group tensors from numpy) add up: a decode step
        # of 64 requests x 3 sites has 192 groups, and the H200 host was ~50 us per copy.
        labels, perm = self.sorted_labels(ORDER)
        groups = list(self.spans(labels, perm, SLOT, SITE))
        if self.sink is not None:
            groups = self._to_sink(labels, groups)
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
        positions = _split(torch.from_numpy(labels[:, POSITION].copy()), 0,
                           [(start, end - start, g) for g, (*_, start, end, _, _)
                            in enumerate(groups)])
        out: dict[str, dict[str, torch.Tensor]] = {}
        for g, (req, slot, site, start, end, first, index) in enumerate(groups):
            rows = data[g] if index is None else \
                self._cut(self.rows[torch.from_numpy(index)], self.formats[(slot, site)])
            name = self.site_names[site]
            out.setdefault(req, {})[name] = rows
            out[req][positions_key(name)] = positions[g]
        return out

    def _to_sink(self, labels: np.ndarray, groups: list) -> list:
        """Sends the groups of sink entries to the sink; returns the others. A request
        that lost rows this step gets the overflow error and sends none of them."""
        tap, lost = self.sink, self.overflow()
        kept, out = [], {}  # (site, format) -> [(request, positions, first row, rows)]
        for group in groups:
            req, slot, site, start, end, first, index = group
            if (slot, site) not in tap.pairs:
                kept.append(group)
            elif req not in lost:
                rows = (first, end - start) if index is None else torch.from_numpy(index)
                out.setdefault((site, self.formats[(slot, site)]), []).append(
                    (req, labels[start:end, POSITION], rows))
        tokens = self.tokens.numpy()
        for (site, fmt), parts in out.items():  # one put per site and format: few, large
            values, tok = self._sink_rows(fmt, [r for *_, r in parts], tokens)
            tap.put(self.site_names[site], [(r, len(p)) for r, p, _ in parts],
                    np.concatenate([p for _, p, _ in parts]), values, tok)
        tap.done()
        return kept

    def _sink_rows(self, fmt: RowFormat, parts: list, tokens: np.ndarray):
        """One site's sink rows in its format, and their token ids. A request's rows of a
        site are one run of the buffer (the usual case): in the buffer's dtype and
        width they go to the writer as views of the pinned step buffer, written from
        there (it returns to the allocator once written; the sink's byte bound counts
        it); otherwise slice copies with the cast in the same pass (an index gather
        then a cast moved every byte twice, and a harvest step is gigabytes)."""
        dtype, width, heads, head_dim = fmt
        if heads is not None or any(not isinstance(p, tuple) for p in parts):
            at = torch.cat([torch.arange(p[0], p[0] + p[1]) if isinstance(p, tuple) else p
                            for p in parts])
            return self._cut(self.rows[at], fmt), tokens[at.numpy()]
        tok = np.concatenate([tokens[first:first + n] for first, n in parts])
        if dtype == self.rows.dtype and width == self.rows.shape[1]:
            views = [self.rows[first:first + n] for first, n in parts]
            return ([v.view(n, -1, head_dim) for v, (_, n) in zip(views, parts)]
                    if head_dim else views), tok
        total = sum(n for _, n in parts)
        values = torch.empty((total, width), dtype=dtype)
        at = 0
        for first, n in parts:
            values[at:at + n].copy_(self.rows[first:first + n, :width])
            at += n
        return (values if not head_dim else values.view(total, -1, head_dim)), tok

    @staticmethod
    def _cut(rows: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
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


def columns(fmt: RowFormat) -> int:
    """Buffer columns an output format reads: its site's width, or with chosen heads up
    to the last of them (rows hold every head in order; _cut takes the chosen ones)."""
    _, width, heads, head_dim = fmt
    return width if heads is None else (max(heads) + 1) * head_dim


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
