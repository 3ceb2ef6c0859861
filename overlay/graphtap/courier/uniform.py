"""The courier's split of a step whose requests all ask the same: every request with the
same sites, the same rows at each and the same output formats (the prefill step of a
burst of one spec: a guard's or an hs probe's last-prompt rows, a qk probe's q and k).
Its result is the array passes' (rows.py CaptureStep._split), made without a Python
pass per (request, site) group: the step that admits a burst carries every one of its
requests' rows, and its sampled tokens wait for the split (benchmarks/cpu:
test_courier_split). uniform_layout says whether a step is so in one pack and how its
rows go, for the tensor split here and for the direct seal (direct.seal_uniform) alike;
split_uniform also takes steps of several packs and sites that travel alone."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from graphtap.courier.chunks import positions_key
from graphtap.courier.pack import SOLO_BYTES, pack_format, pack_key, row_bytes
from graphtap.courier.groups import group_keys


class Uniform(NamedTuple):
    """A uniform step's layout: request i is ids[i], its rows buffer rows
    perm[i * per:(i + 1) * per] (its sites in order, each site's rows in position
    order), all in pack format `fmt` under `key`, its index index[i] (its rows per
    site, then their positions)."""

    ids: list[str]
    perm: np.ndarray
    per: int
    fmt: tuple
    key: str
    index: np.ndarray


class _Shape(NamedTuple):
    """Requests that ask the same: ids, their labels and buffer rows request-major
    (each `per` long: sites ascending, each site's rows in position order), the sites
    (`order`) and rows at each (`counts`), and the formats they share."""

    ids: list[str]
    labels: np.ndarray
    perm: np.ndarray
    per: int
    order: list[int]
    counts: np.ndarray
    formats: dict


def uniform_layout(step, labels: np.ndarray, perm: np.ndarray,
                   cols: tuple[int, int, int]) -> Uniform | None:
    """`step`'s layout (a CaptureStep) from its sorted labels (sorted_labels: each
    (slot, site) group one run, in position order) and the buffer row of each, where
    its requests are uniform in one pack; None where they are not. `cols`: the slot,
    site and position columns."""
    s = _shape(step, labels, perm, cols, one_pack=True)
    if s is None:
        return None
    reqs = len(s.ids)
    # each request's index: its rows per site, then its rows' positions
    index = np.empty((reqs, len(s.order) + s.per), np.int64)
    index[:, :len(s.order)] = s.counts
    index[:, len(s.order):] = s.labels[:, cols[2]].reshape(reqs, s.per)
    return Uniform(s.ids, s.perm, s.per, pack_format(s.formats[s.order[0]]),
                   pack_key([step.site_names[x] for x in s.order]), index)


def _shape(step, labels: np.ndarray, perm: np.ndarray, cols: tuple[int, int, int],
           one_pack: bool) -> _Shape | None:
    """Whether the step's requests ask the same (and, with one_pack, in one pack of
    one format, no site travelling alone), and their rows request-major; else None."""
    slot_col, site_col, _ = cols
    n = len(labels)
    if n < 2:
        return None
    # One request's sites and rows at each first, in a pass over the labels: a step
    # that cannot be uniform (in one pack: a site on its own, several formats) costs
    # no sort
    slot = labels[:, slot_col]
    mine = slot == slot[0]
    per = int(np.count_nonzero(mine))
    formats = step.formats.get(int(slot[0]))
    if n % per or formats is None:
        return None
    rows_of = np.bincount(slot)
    if (rows_of[rows_of > 0] != per).any():
        return None  # requests with more or fewer rows (a step of prefills and decodes)
    order, counts = np.unique(labels[mine, site_col], return_counts=True)
    order = order.tolist()  # the sites, ascending
    if one_pack:
        fmt = pack_format(formats[order[0]])
        if any(pack_format(formats[s]) != fmt for s in order[1:]) or \
                int(counts.max()) * row_bytes(fmt) >= SOLO_BYTES:
            return None  # packs of several formats, or a site on its own
    # request-major (the device writes rows site-major; each group stays in order)
    keys = group_keys(slot, labels[:, site_col])
    if (keys[1:] < keys[:-1]).any():
        by_group = np.argsort(keys, kind="stable")
        labels, perm = labels[by_group], perm[by_group]
        slot = labels[:, slot_col]
    reqs = n // per
    starts = np.arange(0, n, per)
    sites = labels[:, site_col].reshape(reqs, per)
    if reqs > 1 and ((slot[starts[1:]] == slot[starts[:-1]]).any() or
                     (slot.reshape(reqs, per) != slot[starts, None]).any() or
                     (sites != sites[0]).any()):
        return None  # requests with other rows, sites or rows per site
    slots = slot[starts].tolist()
    ids = [step.slot_to_req.get(s) for s in slots]
    if None in ids or any(step.formats[s] is not formats and step.formats[s] != formats
                          for s in slots):
        return None  # a request gone (its rows are left out), or asking otherwise
    return _Shape(ids, labels, perm, per, order, counts, formats)


class FormatRows(NamedTuple):
    """One output format's rows of a uniform step, request-major: the buffer rows of
    every request (`rows`, each request's sum(sizes) long), cut per request into pieces
    of `sizes` rows: its pack of the format's smaller sites under `key` (None: none),
    then each site with SOLO_BYTES of rows or more under its name (`names`). Per
    request (one row each) the rows' positions and the pack's index (its sites' row
    counts, then their positions; None without a pack)."""

    fmt: tuple
    rows: np.ndarray
    sizes: list[int]
    key: str | None
    names: list[str]
    positions: np.ndarray
    index: np.ndarray | None


def uniform_formats(step, labels: np.ndarray, perm: np.ndarray, cols: tuple[int, int, int]
                    ) -> tuple[list[str], list[FormatRows]] | None:
    """Where `step`'s requests are uniform (_shape), its request ids and per output
    format (in the order _split meets them) how their rows go, as _split makes its
    chunks; else None. For split_uniform's tensors and direct.seal_request_major's
    sealed values alike."""
    s = _shape(step, labels, perm, cols, one_pack=False)
    if s is None:
        return None
    reqs, (_, _, pos_col) = len(s.ids), cols
    offsets = np.cumsum(s.counts) - s.counts  # each site's first row in a request's
    by_fmt: dict[tuple, tuple[list[int], list[int]]] = {}
    for j, site in enumerate(s.order):  # formats in the order _split meets them
        fmt = pack_format(s.formats[site])
        solo = int(s.counts[j]) * row_bytes(fmt) >= SOLO_BYTES
        by_fmt.setdefault(fmt, ([], []))[solo].append(j)
    perm = s.perm.reshape(reqs, s.per)
    positions = s.labels[:, pos_col].astype(np.int64).reshape(reqs, s.per)
    plans = []
    for fmt, (packed, solos) in by_fmt.items():
        # a request's rows of this format: its packed sites', then each solo site's (all
        # its rows, in order, where it is one pack: a decode step's, no reordering)
        sel = slice(None) if len(packed) == len(s.order) else np.concatenate(
            [np.arange(offsets[j], offsets[j] + s.counts[j]) for j in packed + solos])
        sizes = ([int(s.counts[packed].sum())] if packed else []) + \
            [int(s.counts[j]) for j in solos]
        mine, key, index = positions[:, sel], None, None
        if packed:
            key = pack_key([step.site_names[s.order[j]] for j in packed])
            index = np.empty((reqs, len(packed) + sizes[0]), np.int64)
            index[:, :len(packed)] = s.counts[packed]
            index[:, len(packed):] = mine[:, :sizes[0]]
        plans.append(FormatRows(fmt, perm[:, sel].reshape(-1), sizes, key,
                                [step.site_names[s.order[j]] for j in solos], mine, index))
    return s.ids, plans


def split_uniform(step, labels: np.ndarray, perm: np.ndarray,
                  cols: tuple[int, int, int]) -> dict[str, dict[str, torch.Tensor]] | None:
    """`step`'s split where its requests are uniform (_shape), else None (the array
    passes then split it): per output format one gather of every request's rows, each
    request's pack of that format's smaller sites one slice of it and each site with
    SOLO_BYTES of rows or more one slice of its own, as _split makes them."""
    found = uniform_formats(step, labels, perm, cols)
    if found is None:
        return None
    ids, plans = found
    out: dict[str, dict[str, torch.Tensor]] = {req: {} for req in ids}
    for p in plans:
        pieces = p.sizes * len(ids)
        data = step._gather(p.rows, p.fmt).split(pieces)
        at = torch.from_numpy(p.positions.reshape(-1)).split(pieces) if p.names else ()
        index_rows = torch.from_numpy(p.index).unbind(0) if p.key else ()
        per = len(p.sizes)
        for i, req in enumerate(ids):
            chunk, first = out[req], i * per
            if p.key:
                chunk[p.key], chunk[positions_key(p.key)] = data[first], index_rows[i]
                first += 1
            for k, name in enumerate(p.names):
                chunk[name], chunk[positions_key(name)] = data[first + k], at[first + k]
    return out
