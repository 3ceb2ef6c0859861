"""The courier's split of a step whose requests all ask the same: every request with the
same sites, the same rows at each, in one output format, packed together (the prefill
step of a burst of one spec: a guard's or an hs probe's last-prompt rows). Its result
is the array passes' (rows.py CaptureStep._split), made without a Python pass per
(request, site) group: the step that admits a burst carries every one of its requests'
rows, and its sampled tokens wait for the split (benchmarks/cpu: test_courier_split).
uniform_layout says whether a step is so and how its rows go, for the tensor split
here and for the direct seal (direct.seal_uniform) alike."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from graphtap.courier.chunks import positions_key
from graphtap.courier.pack import SOLO_BYTES, pack_format, pack_key, row_bytes
from graphtap.courier.snapshot import group_keys


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


def uniform_layout(step, labels: np.ndarray, perm: np.ndarray,
                   cols: tuple[int, int, int]) -> Uniform | None:
    """`step`'s layout (a CaptureStep) from its sorted labels (sorted_labels: each
    (slot, site) group one run, in position order) and the buffer row of each, where
    its requests are uniform; None where they are not. `cols`: the slot, site and
    position columns."""
    slot_col, site_col, pos_col = cols
    n = len(labels)
    if n < 2:
        return None
    # One request's sites and rows at each first, in a pass over the labels: a step
    # that cannot be uniform (a site on its own, several formats) costs no sort
    slot = labels[:, slot_col]
    mine = slot == slot[0]
    per = int(np.count_nonzero(mine))
    formats = step.formats.get(int(slot[0]))
    if n % per or formats is None:
        return None
    order, counts = np.unique(labels[mine, site_col], return_counts=True)
    order = order.tolist()  # the sites, ascending
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
    # each request's index: its rows per site, then its rows' positions
    index = np.empty((reqs, len(order) + per), np.int64)
    index[:, :len(order)] = counts
    index[:, len(order):] = labels[:, pos_col].reshape(reqs, per)
    return Uniform(ids, perm, per, fmt, pack_key([step.site_names[s] for s in order]), index)


def split_uniform(step, labels: np.ndarray, perm: np.ndarray,
                  cols: tuple[int, int, int]) -> dict[str, dict[str, torch.Tensor]] | None:
    """`step`'s split where its requests are uniform (uniform_layout), else None (the
    array passes then split it)."""
    u = uniform_layout(step, labels, perm, cols)
    if u is None:
        return None
    parts = step._gather(u.perm, u.fmt).split(u.per)  # request-major: one slice each
    at = positions_key(u.key)
    return {req: {u.key: rows, at: idx}
            for req, rows, idx in zip(u.ids, parts, torch.from_numpy(u.index).unbind(0))}
