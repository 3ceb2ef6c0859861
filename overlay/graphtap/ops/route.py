"""Per-step routing on the device, torch references (the spec of truth, and the CPU path).

`route_tokens_reference`: each token row's request slot and batch row, for every hook.
`route_rows_reference`: for a row family (captures, attention patterns), every wanted
(site, token row, head) unit, the buffer row it gets and its label (ops.tables.Label).
Units are numbered site-major, then token, then head (ascending); units past the buffer's
capacity go to the trash row and are counted, so the courier reports an overflow instead
of losing rows. Runs on the host's stream before the forward (not inside the graph): it
fills what the graph's ops and the courier read. route_triton.py does the same in a few
launches.
"""
from __future__ import annotations

import functools

import torch

from graphtap.ops.tables import LABEL_DTYPE, Label, RowTables, entry_bits


@functools.lru_cache(maxsize=8)
def _arange(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """0..size-1, made once per table size and device and sliced every step."""
    return torch.arange(size, dtype=dtype, device=device)


def route_tokens_reference(tok_slot: torch.Tensor, tok_row: torch.Tensor, sentinel: int,
                           qsl: torch.Tensor, idx_mapping: torch.Tensor, n: int,
                           num_reqs: int) -> None:
    """tok_slot[:n] and tok_row[:n] from the batch's query start locations (qsl
    [num_reqs + 1]) and its batch row -> slot map; rows past the last request's tokens
    (padding) get the sentinel."""
    qsl = qsl[: num_reqs + 1]
    rows = _arange(tok_slot.shape[0], qsl.dtype, qsl.device)[:n]
    batch_row = torch.searchsorted(qsl[1:].contiguous(), rows, right=True)
    batch_row.clamp_(max=num_reqs - 1)
    slot = idx_mapping[batch_row].to(torch.int64)
    slot = torch.where(rows < qsl[num_reqs], slot, sentinel)
    tok_slot[:n].copy_(slot)
    tok_row[:n].copy_(batch_row)


def route_rows_reference(t: RowTables, slot: torch.Tensor, brow: torch.Tensor,
                         positions: torch.Tensor, max_len: int,
                         sync_free: bool | None = None) -> None:
    """slot, brow [n]: each token row's request slot (the sentinel: none) and batch row;
    positions [n] (any integer dtype), clamped to [0, max_len) as the ops clamp them.
    sync_free (default: on a GPU) labels every unit without a host sync; otherwise only
    the wanted ones are labelled, which is cheaper where there is no device to stall."""
    n, dev = slot.shape[0], slot.device
    pos = positions.long().clamp(0, max_len - 1)
    num_sites = t.num_sites
    tokens = _arange(t.flags.shape[1], torch.long, dev)[:n]
    # All entries at once: a fixed number of kernels per step, whatever the entry count.
    # A request names each site once, so active (site, token) pairs never collide;
    # inactive entries write into an extra, dropped site row.
    site = t.entry_site[slot].long()  # [n, C]
    on = (site >= 0) & entry_bits(t.entry_pos, slot, pos)
    target = (torch.where(on, site, num_sites), tokens[:, None].expand_as(site))
    if t.entry_heads is None:
        want = torch.zeros((num_sites + 1, n), dtype=torch.bool, device=dev)
        want.index_put_(target, on)
        want = want.unsqueeze(2)
    else:
        heads = t.entry_heads[slot] != 0  # [n, C, Hq]
        want = torch.zeros((num_sites + 1, n, heads.shape[2]), dtype=torch.bool, device=dev)
        want.index_put_(target, heads & on[:, :, None])
    h = want.shape[2]
    wanted = t.count[1:]
    wanted.zero_()
    wanted.index_add_(0, slot, want[:num_sites].sum((0, 2)).to(wanted.dtype))
    sync_free = dev.type == "cuda" if sync_free is None else sync_free
    _fit_requests(t.fits, wanted, t.rows, sync_free)
    want[:num_sites] &= (t.fits[slot] != 0)[None, :, None]
    flat = want[:num_sites].flatten()
    index = torch.cumsum(flat, 0) - 1
    dst = torch.where(flat, index, t.rows)  # the requests that fit fit whole: index < K
    if t.dst is not None:
        t.dst[:, :n].copy_(dst.view(num_sites, n))
    t.count[:1].copy_(flat.sum().reshape(1))
    t.labels[:, Label.SITE].fill_(-1)
    if sync_free:
        _label_every_unit(t, dst, slot, brow, pos, tokens, num_sites, n, h)
    else:  # no device to stall: label the wanted units only (rows 0..k-1, in unit order)
        units = flat.nonzero().squeeze(1)[: t.rows]
        site_of, rest = units // (n * h), units % (n * h)
        tok, head = rest // h, rest % h
        columns = {Label.SLOT: slot[tok], Label.SITE: site_of, Label.POSITION: pos[tok],
                   Label.HEAD: head, Label.TOKEN: tok, Label.BATCH_ROW: brow[tok]}
        t.labels[: len(units)] = torch.stack([columns[c].to(LABEL_DTYPE) for c in Label], 1)


def _fit_requests(fits: torch.Tensor, wanted: torch.Tensor, rows: int, sync_free: bool) -> None:
    """fits[s] = 1 where slot s's units all get rows: slots taken whole, in order, while
    the buffer has room for them (route_triton's _fit_kernel does the same)."""
    if not sync_free:  # on the host: one pass
        used, ok = 0, []
        for c in wanted.tolist():
            take = used + c <= rows
            used += c if take else 0
            ok.append(int(take))
        fits.copy_(torch.tensor(ok, dtype=fits.dtype))
        return
    used = torch.zeros((), dtype=wanted.dtype, device=wanted.device)
    for s in range(wanted.shape[0]):  # without a sync: a debugging path only
        take = used + wanted[s] <= rows
        fits[s] = take
        used += torch.where(take, wanted[s], 0)


def _label_every_unit(t: RowTables, dst, slot, brow, pos, tokens, num_sites, n, h) -> None:
    """Every unit's label, one stack of broadcast views [sites, tokens, heads, LABELS],
    copied to its row; the units not wanted all land in the trash row."""
    dev = slot.device
    shape = (num_sites, n, h)
    columns = {Label.SLOT: slot[None, :, None], Label.POSITION: pos[None, :, None],
               Label.SITE: _arange(num_sites, torch.long, dev)[:, None, None],
               Label.HEAD: _arange(h, torch.long, dev)[None, None, :],
               Label.TOKEN: tokens[None, :, None], Label.BATCH_ROW: brow[None, :, None]}
    labels = torch.stack([columns[c].to(LABEL_DTYPE).expand(shape) for c in Label], dim=-1)
    t.labels.index_copy_(0, dst, labels.view(-1, len(Label)))
    t.labels[t.rows, Label.SITE] = -1
