"""The courier's split of a capture step: each request's rows per site, in the format it
asked for (dtype, chosen heads), packed per format (pack.py) in tensors of their own
(never views of the pinned step buffer, which would keep it from going back to the
caching host allocator)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from graphtap.courier.chunks import ERROR, error_tensor, positions_key
from graphtap.courier.direct import plain_groups, seal_request_major, seal_small, seal_uniform
from graphtap.courier.pack import (SOLO_BYTES, column_span, head_runs, pack_format, pack_key,
                                   packed_index, ramp, row_bytes, run_starts)
from graphtap.courier.sink import SinkFailed
from graphtap.courier.sink_labels import SlotRequests
from graphtap.courier.snapshot import LabelledStep
from graphtap.courier.uniform import split_uniform, uniform_layout
from graphtap.ops.tables import Label

# plain ints: numpy indexes with them on every step
ORDER = (int(Label.SLOT), int(Label.SITE), int(Label.POSITION))
SLOT, SITE, POSITION = ORDER
HOST_LABELS = len(ORDER)  # label columns a capture step copies home
# A sink tap's format ids (engine/families/capture.py SinkTap.format_of) beside the
# formats': a (slot, site) whose rows come back with the request, and in one step the
# rows of a sink request that lost rows (they are dropped: it gets the overflow error).
NO_SINK, LOST = -1, -2


class RowFormat(NamedTuple):
    """How a request gets one site's rows back."""

    dtype: torch.dtype
    width: int  # the site's row width (hidden size, or heads x head_dim)
    heads: tuple[int, ...] | None  # chosen heads (attention sites); None: the whole row
    head_dim: int  # 0 for residual sites


class CaptureStep(LabelledStep):
    """A capture step; labels (slot, site, position) per row."""

    staged = None  # the offset of the sink's staging block its rows were copied into
    # Steps of at most this many rows are split in plain Python (_split_small): the array
    # passes' fixed cost (some 60 numpy and torch calls, ~200 us on the dev CPU whatever
    # the rows) was most of a small step's split, as a burst's first steps (one or a few
    # requests' last-prompt rows), which the engine's next admissions wait for. Plain
    # Python costs ~35 us a request there: past ~10 requests the array passes win.
    small_rows = 32
    # Steps of at most this many rows are sealed from the host copy (sealed(): a Python
    # pass over the rows, no tensor calls per request; test_bench_delivery.py)
    direct_rows = 512
    # ... and from this many rows on, where every request asks the same, in array passes
    # (direct.seal_uniform): their fixed cost (~40 us on the dev CPU) beats the Python
    # pass's per row and group past some 10 requests' last-prompt rows at 3 sites
    uniform_rows = 32

    def _rows_home(self, rows: torch.Tensor) -> tuple[object, torch.Tensor | None]:
        # A sink step's rows go home on the sink's own stream, into its staging block
        # where it has one: the writer waits for rows_ready before it writes them; the
        # per-request split of the step's other rows waits at its first read of them.
        stream = None if self.sink is None else self.sink.stream
        if stream is None:
            return super()._rows_home(rows)
        staged = self.sink.writer.stage(rows)  # the sink's pinned memory (or None)
        if staged is None:
            return stream, None
        self.staged, host = staged
        return stream, host

    def _gathered(self) -> dict[str, dict[str, torch.Tensor]]:
        handed = 0  # bytes of a staging block handed to the writer as views
        try:
            keep, failed, handed = self._to_sink() if self.sink is not None else (None, {}, 0)
            if keep is not None and not keep.any():
                return failed  # every row went to the sink (a harvest's steps)
            small = keep is None and \
                self.used_rows() <= self.small_rows
            return {**(self._split_small() if small else self._split(keep)), **failed}
        finally:
            if self.staged is not None:  # the block goes back once the views are written
                self.sink.writer.settle(self.staged, handed)
                self.staged = None

    def sealed(self, inline=()):
        """Payload values per request straight from the host copy (direct.py), or None:
        the chunk way. Only a step whose rows all came home, no sink: of at most
        direct_rows rows, or larger where its requests all ask the same (`inline`: the
        requests whose values all travel inside the message)."""
        if self.sink is not None or not self.rows.is_contiguous():
            return None
        count = self.count.tolist()
        used = count[0]
        if not self.all_home(count):
            return None
        if not used:
            return {}
        raw = self.rows.view(torch.uint8).numpy()
        if used > self.direct_rows:
            return seal_request_major(self, *self.sorted_labels(ORDER), ORDER, raw,
                                      self.rows.dtype, inline)
        labels = self.labels.numpy()[:used]
        if used >= self.uniform_rows:
            # one lexsort: cheaper here than sorted_labels' order check and the
            # layout's regrouping of the device's site-major rows
            perm = np.lexsort(tuple(labels[:, c] for c in reversed(ORDER)))
            layout = uniform_layout(self, labels[perm], perm, ORDER)
            uniform = seal_uniform(layout, raw, self.rows.dtype) if layout else None
            if uniform is not None:
                return uniform
        return seal_small(labels[:, :HOST_LABELS], raw, self.rows.dtype,
                          self.formats, self.site_names, self.slot_to_req)

    def _split(self, keep: np.ndarray | None) -> dict[str, dict[str, torch.Tensor]]:
        """The rows `keep` marks (all: None), per request: per output format one pack of
        its sites (pack.py), a site with SOLO_BYTES of rows or more on its own, each a
        view of one copy made for the whole step."""
        # Copies out of the pinned step buffer (a view would keep it from going back to
        # the caching host allocator) of the bytes returned only, one per output format:
        # its rows gathered in request order (the device writes them site-major), so
        # that each request's rows are one slice of it. A row spans the widest
        # configured site (Llama-3-8B: 4096 columns) where a k row of 4 heads uses 512;
        # copying whole rows made a qk prefill step of 8 x 256 tokens cost 12 ms here,
        # 67 MB moved for 8. Per-group copies add up: a decode step of 64 requests x 3
        # sites has 192 groups, and the H200 host was ~50 us per copy.
        labels, perm = self.sorted_labels(ORDER, keep)
        if keep is None:  # a burst of one spec: one pack per request, in array passes
            uniform = split_uniform(self, labels, perm, ORDER)
            if uniform is not None:
                return uniform
        packs: dict[RowFormat, list[tuple[int, bool, int, int, int, str]]] = {}
        # a format's pack format and row bytes once a step, not once a (request, site)
        # group: a qk burst's step of prefills and decodes has 512 groups
        known: dict[RowFormat, tuple[RowFormat, int]] = {}
        for req, slot, site, start, end, _, _ in self.spans(labels, perm, SLOT, SITE):
            asked = self.formats[slot][site]
            if (found := known.get(asked)) is None:
                fmt = pack_format(asked)
                found = known[asked] = fmt, row_bytes(fmt)
            fmt, size = found
            packs.setdefault(fmt, []).append((slot, (end - start) * size >= SOLO_BYTES,
                                              site, start, end - start, req))
        out: dict[str, dict[str, torch.Tensor]] = {}
        for fmt, members in packs.items():
            # by request (slot), its packed sites first (one slice), then its solo ones
            members.sort()
            slot, solo, site, start, n = np.array([m[:5] for m in members], np.int64).T
            at = np.repeat(start, n) + ramp(n)  # the rows in the sorted labels, in order
            data = self._gather(perm[at], fmt)
            positions = labels[at, POSITION].astype(np.int64)
            packed = solo == 0
            if packed.any():
                p_slot, p_n = slot[packed], n[packed]
                firsts = run_starts(p_slot[1:] != p_slot[:-1])
                sites = np.diff(np.append(firsts, len(p_n)))  # each request's packed sites
                rows = np.add.reduceat(p_n, firsts)  # and their rows
                index = torch.from_numpy(packed_index(
                    p_n, sites, rows, positions[np.repeat(packed, n)])).split(
                        (sites + rows).tolist())
            # the data's pieces: per request its pack (if any), then each solo site (a
            # piece starts at a new request and at every solo member)
            firsts = run_starts((slot[1:] != slot[:-1]) | (solo[1:] != 0))
            sizes = np.add.reduceat(n, firsts).tolist()
            parts = data.split(sizes)
            pos = torch.from_numpy(positions).split(sizes)
            packs_seen = 0
            for first, end, rows_part, pos_part in zip(
                    firsts.tolist(), np.append(firsts[1:], len(members)).tolist(), parts, pos):
                chunk = out.setdefault(members[first][5], {})
                if solo[first]:  # its own tensor: it reaches the frontend as its own
                    name = self.site_names[members[first][2]]
                    chunk[name], chunk[positions_key(name)] = rows_part, pos_part
                    continue
                key = pack_key([self.site_names[m[2]] for m in members[first:end]])
                chunk[key], chunk[positions_key(key)] = rows_part, index[packs_seen]
                packs_seen += 1
        return out

    def _split_small(self) -> dict[str, dict[str, torch.Tensor]]:
        """_split's result for a step of few rows, grouped in plain Python over the
        labels (direct.plain_groups; tests/test_courier_units.py holds it to _split)."""
        used = self.used_rows()
        out: dict[str, dict[str, torch.Tensor]] = {}
        for req, key, fmt, rows, index in plain_groups(
                self.labels[:used, :HOST_LABELS].numpy(), self.formats, self.site_names,
                self.slot_to_req):
            chunk = out.setdefault(req, {})
            chunk[key] = self._gather(np.array(rows, np.int64), fmt)
            chunk[positions_key(key)] = torch.tensor(index, dtype=torch.int64)
        return out

    def _gather(self, rows: np.ndarray, fmt: RowFormat) -> torch.Tensor:
        """Buffer rows `rows` in an output format, as a new contiguous tensor: one copy
        (a slice where they are one run, else one index_select of the columns read),
        a second pass only for a cast or chosen heads that are not one run."""
        dtype, head_dim = fmt.dtype, fmt.head_dim
        lo, hi, cut = column_span(fmt, self.rows.shape[1])
        src = self.rows[:, lo:hi]
        first = int(rows[0])
        if rows[-1] - first + 1 == len(rows) and (np.diff(rows) == 1).all():
            data, copied = src[first:first + len(rows)], False
        else:
            data, copied = torch.index_select(src, 0, torch.from_numpy(rows)), True
        if cut:
            return self._cut(data, fmt)
        if head_dim:
            data = data.unflatten(1, (-1, head_dim))
        if copied and data.dtype == dtype:
            return data
        return data.to(dtype, copy=True).contiguous()

    def _to_sink(self) -> tuple[np.ndarray, dict, int]:
        """Sends the rows of sink entries to the sink in one hand-over: per site and format
        the runs of the buffer that hold them (a site's rows are one run in the usual
        step, the device writing them site-major), found with array operations over the
        step's labels, never per request (a decode step of 64 requests x 32 sites has
        2048 one-row groups). A request that lost rows this step gets the overflow
        error and sends none of them. Returns which rows are left for the per-request
        split; the step's sink requests failed by a writer that stopped (a full disk:
        each gets the cause, the engine goes on); and the bytes of the step copy handed
        over as views (a staging block is freed once they are written)."""
        tap = self.sink
        failed: dict[str, dict[str, torch.Tensor]] = {}
        handed = 0
        used = self.used_rows()
        if not used:
            tap.done()
            return np.zeros(0, dtype=bool), failed, handed
        labels = self.labels[:used].numpy()
        slot, site, position = labels[:, SLOT], labels[:, SITE], labels[:, POSITION]
        tokens = self.tokens.numpy()[:used]
        n_fmt = len(tap.formats)
        lost = self.overflow()
        whole = None if lost else self._whole_runs(site, used)
        if whole is not None:  # a harvest's step: every row to the sink, as views
            sunk = [(self.site_names[key // n_fmt], sum(b - a for a, b in spans),
                     [self._view(a, b, tap.formats[key % n_fmt]) for a, b in spans])
                    for key, spans in whole.items()]
            handed = self._hand_over(slot, position, tokens, sunk, self.rows_ready, failed)
            tap.done()
            return np.zeros(0, dtype=bool), failed, handed
        # per row a run key: site x formats + format id for sink rows, else NO_SINK; from
        # a [slot, site] table by one flat gather (2-D fancy indexing cost 4x as much)
        sites = tap.format_of.shape[1]
        table = np.where(tap.format_of >= 0,
                         np.arange(sites, dtype=np.int64) * n_fmt + tap.format_of,
                         tap.format_of.astype(np.int64))
        keys = table.reshape(-1)[slot * sites + site]
        if lost:
            lost_slots = [s for s, r in self.slot_to_req.items() if r in lost]
            keys[np.isin(slot, lost_slots) & (keys >= 0)] = LOST
        starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
        ends = np.concatenate((starts[1:], [used]))
        runs: dict[int, list[tuple[int, int]]] = {}
        for start, end, key in zip(starts.tolist(), ends.tolist(), keys[starts].tolist()):
            if key >= 0:
                runs.setdefault(key, []).append((start, end))
        if runs:  # one hand-over a step: per site and format the runs that hold it
            if all(len(spans) == 1 for spans in runs.values()):  # the usual: in order
                mask = keys >= 0
                at = slice(None) if mask.all() else np.flatnonzero(mask)
            else:
                at = np.concatenate([np.arange(a, b) for spans in runs.values()
                                     for a, b in spans])
            ready = self.rows_ready
            if ready is not None and any(tap.formats[key % n_fmt] != self._native(
                    tap.formats[key % n_fmt]) for key in runs):
                self._wait_rows()  # a format other than the buffer's is a copy made here
                ready = None
            sunk = [(self.site_names[key // n_fmt], sum(b - a for a, b in spans),
                     [self._sink_values(a, b, tap.formats[key % n_fmt]) for a, b in spans])
                    for key, spans in runs.items()]
            handed = self._hand_over(slot[at], position[at], tokens[at], sunk, ready, failed)
        tap.done()
        return keys == NO_SINK, failed, handed

    def _hand_over(self, slot: np.ndarray, position: np.ndarray, token: np.ndarray,
                   sunk: list, ready, failed: dict) -> int:
        """One put_runs of the step's runs, labelled by the rows' slot, position and token
        labels as they are (the writer's thread makes its int64 copies: SlotRequests).
        Returns the bytes handed over as views of the step copy (a staging block is freed
        once they are written); a writer that stopped fails each request with rows here
        with the cause instead (into `failed`)."""
        try:
            self.sink.writer.put_runs(SlotRequests(self.sink.request_of, slot), position,
                                      token, sunk, ready)
        except SinkFailed as e:
            for s in np.unique(slot).tolist():
                failed[self.slot_to_req[s]] = {ERROR: error_tensor(str(e))}
            return 0
        if self.staged is None:
            return 0
        storage = self._rows.untyped_storage().data_ptr()
        return sum(c.numel() * c.element_size() for _, _, chunks in sunk for c in chunks
                   if c.untyped_storage().data_ptr() == storage)

    def _whole_runs(self, site: np.ndarray, used: int) -> dict | None:
        """A step whose every row goes to the sink, each site in one format that is a view
        of the step copy (a harvest's steps): its runs by key (site x formats + format
        id), found from the site labels alone. None: the rows are decided one by one."""
        tap = self.sink
        slots = np.fromiter(self.slot_to_req, np.int64, len(self.slot_to_req))
        if tap.whole is None or not len(slots) or not tap.whole[slots].all():
            return None
        ids = tap.format_of[slots]  # [slots, sites]: a format id where a slot captures
        fmt = ids.max(0)
        if (np.where(ids >= 0, ids, fmt) != fmt).any():
            return None  # a site sunk in two formats (requests differ): row by row
        if any(tap.formats[f] != self._native(tap.formats[f]) for f in set(fmt.tolist())
               if f >= 0):
            return None  # a cast or chosen heads: copies, made row by row
        starts = np.flatnonzero(np.concatenate(([True], site[1:] != site[:-1])))
        ends = np.concatenate((starts[1:], [used]))
        runs: dict[int, list[tuple[int, int]]] = {}
        n_fmt = len(tap.formats)
        for start, end, s in zip(starts.tolist(), ends.tolist(), site[starts].tolist()):
            if fmt[s] < 0:
                return None  # a row of a site no request sinks: never expected
            runs.setdefault(s * n_fmt + int(fmt[s]), []).append((start, end))
        return runs

    def _view(self, start: int, end: int, fmt: RowFormat) -> torch.Tensor:
        """A run of rows in a native format (_native): a view of the step copy."""
        rows = self._rows[start:end]  # no wait: the writer waits for rows_ready
        return rows.view(end - start, -1, fmt.head_dim) if fmt.head_dim else rows

    def _sink_values(self, start: int, end: int, fmt: RowFormat) -> torch.Tensor:
        """A run of sink rows in its format: in the buffer's dtype and width, a view of the
        pinned step buffer, written from there (it returns to the allocator once written;
        the sink's byte bound counts it); otherwise a copy with the cast and the chosen
        heads in one pass."""
        if fmt == self._native(fmt):
            return self._view(start, end, fmt)
        return self._cut(self.rows[start:end], fmt)

    def _native(self, fmt: RowFormat) -> RowFormat:
        """The format in which a site's rows are views of the step copy (no copy made)."""
        return fmt._replace(dtype=self._rows.dtype, width=self._rows.shape[1], heads=None)

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
                for dst, src, n in head_runs(heads):
                    out[:, dst:dst + n].copy_(data[:, src:src + n])
                return out
        return data.to(dtype, copy=True).contiguous()
