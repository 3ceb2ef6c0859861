"""A request's capture rows of one step as few tensors: each costs its own entry on the
way to the frontend (payload.py; when every value was a tensor on vLLM's msgpack path, a
request capturing 3 sites sent 6 a step, and 64 of them added ~6 ms to their first token
on the H200: benchmarks/cpu/test_bench_delivery.py measures the hop).

Per output format, one rows tensor holds the request's sites one after another, keyed
`PACK` + the site names in that order; `positions_key` of that key holds an int64 index:
the rows of each site, then every row's position. A site with SOLO_BYTES of rows or
more in the step keeps its own two entries (name, positions_key(name)). The frontend
unpacks a chunk before it merges the steps (assemble.py).

Here too the output formats' columns (columns, pack_format, column_span, head_runs),
which the step's split (rows.py), its uniform split and the direct seal read alike."""
from __future__ import annotations

import functools

import numpy as np
import torch

from graphtap.courier.chunks import positions_key

PACK = "graphtap:pack:"
# A site's rows of one step this large travel as a tensor of their own, as before packs:
# they reach the frontend as a frame of their own, which it keeps as the result, where
# sites out of a pack are copied apart at finish (a qk burst's 64 MB of k rows, one
# pack per request: 0.25-0.45 s of the frontend's event loop on the H200 host, fresh
# memory's page faults). Below it, a tensor's fixed cost outweighs the copy.
SOLO_BYTES = 16 << 10


def pack_key(names: list[str]) -> str:
    return PACK + ",".join(names)


def pack(names: list[str], rows: list[torch.Tensor],
         positions: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """One request's pack of sites, built from its pieces (a copy): the rows tensor and
    its index (the rows of each site, then every row's position)."""
    key = pack_key(names)
    counts = np.array([len(p) for p in positions], np.int64)
    index = np.concatenate([counts, *positions]).astype(np.int64)
    return {key: torch.cat(rows), positions_key(key): torch.from_numpy(index)}


def row_bytes(fmt) -> int:
    """Bytes of one row in an output format (courier.rows.RowFormat)."""
    dtype, width, heads, head_dim = fmt
    return dtype.itemsize * (len(heads) * head_dim if heads is not None else width)


def columns(fmt) -> int:
    """Buffer columns an output format reads: its site's width, or with chosen heads up
    to the last of them (rows hold every head in order; the cut takes the chosen ones)."""
    _, width, heads, head_dim = fmt
    return width if heads is None else (max(heads) + 1) * head_dim


def pack_format(fmt):
    """The format rows share a pack in: chosen heads read the same columns of any site
    (q and k of heads 0-3 alike), whatever its width."""
    return fmt if fmt.heads is None else fmt._replace(width=columns(fmt))


def column_span(fmt, available: int) -> tuple[int, int, bool]:
    """(first, end) of the buffer columns an output format's rows are read from, in a
    step copy of `available` columns, and whether its chosen heads must then be cut
    apart (they are not one run): the courier's copies and the direct seal alike."""
    _, width, heads, head_dim = fmt
    if heads is None:  # the whole row; every head (a narrowed row may end mid-head)
        end = min(width, available)
        return 0, end // head_dim * head_dim if head_dim else end, False
    runs = head_runs(heads)
    if len(runs) == 1:  # the usual: heads a..b, one block of columns
        return runs[0][1] * head_dim, (runs[0][1] + runs[0][2]) * head_dim, False
    return 0, columns(fmt), True


@functools.lru_cache(maxsize=256)
def head_runs(heads: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """(output index, source head, count) per run of consecutive heads, in the order
    asked: (0, 1, 2, 3) is one run, (5, 2, 3) two."""
    runs: list[list[int]] = []
    for i, h in enumerate(heads):
        if runs and h == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([i, h, 1])
    return tuple(tuple(r) for r in runs)


def packed_index(counts: np.ndarray, sites: np.ndarray, rows: np.ndarray,
                 positions: np.ndarray) -> np.ndarray:
    """Every request's index of one pack, back to back: for request r, its `sites[r]`
    row counts (counts, flat over the requests) then the positions of its `rows[r]`
    rows (positions, flat). In array operations: a decode step of 64 requests x 3 sites
    is 192 groups."""
    sizes = sites + rows
    out = np.empty(int(sizes.sum()), np.int64)
    start = np.cumsum(sizes) - sizes  # each request's first entry
    # the headers at start[r] + 0..sites[r]-1, the positions after them
    head = np.repeat(start, sites) + ramp(sites)
    out[head] = counts
    body = np.ones(len(out), bool)
    body[head] = False
    out[body] = positions
    return out


def run_starts(changed: np.ndarray) -> np.ndarray:
    """Where each run starts, from `changed[i]`: element i + 1 differs from element i
    (np.r_ would do it in one expression at several times the cost: the split calls
    this a few times per step, on the first token's critical path)."""
    return np.flatnonzero(np.concatenate(([True], changed)))


def ramp(sizes: np.ndarray) -> np.ndarray:
    """0..n-1 for each n in sizes, concatenated."""
    total = int(sizes.sum())
    return np.arange(total) - np.repeat(np.cumsum(sizes) - sizes, sizes)


def unpack(chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A step's chunk with its packs split back into one entry per site (name, and its
    positions_key): views of the packs, in the pack's order."""
    if not any(k.startswith(PACK) for k in chunk):
        return chunk
    out = {}
    for key, t in chunk.items():
        if not key.startswith(PACK):
            out[key] = t
        elif "@" not in key:
            names = key[len(PACK):].split(",")
            index = chunk[positions_key(key)]
            counts = index[:len(names)].tolist()
            positions = index[len(names):]
            if sum(counts) != len(t) or len(positions) != len(t):
                raise ValueError(f"graphtap: a pack of {len(t)} rows came with counts "
                                 f"{counts} and {len(positions)} positions")
            for name, rows, pos in zip(names, t.split(counts), positions.split(counts)):
                out[name], out[positions_key(name)] = rows, pos
    return out
