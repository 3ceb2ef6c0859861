"""graphtap harvest's transport over the engine's bulk sink (courier/sink.py): a run of
prompts is generated with `"sink": true` captures, so their rows leave the worker by its
writer thread and never pass through the per-request output merge; the harvest then
asks the worker to finish writing (graphtap_sink_sync), reads the sink shards that run
made, and hands back the same per-prompt rows the per-request path gives (the shards it
writes are byte-identical either way). The sink files it read are removed."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def sink_index(llm) -> dict | None:
    """The engine's sink index once every row is written; None without a sink."""
    found = [i for i in llm.collective_rpc("graphtap_sink_sync") if i is not None]
    if len(found) > 1:
        raise RuntimeError("harvest: more than one sink answered (data parallel: harvest "
                           "one replica at a time)")
    if found and found[0].get("error"):
        raise RuntimeError(f"harvest: the engine's sink stopped ({found[0]['error']}); "
                           f"the shards written before are kept: run again to resume")
    return found[0] if found else None


def rows_from_sink(llm, outs: list, sites: tuple[str, ...], seen: set[str],
                   first: int) -> tuple[list[dict[str, torch.Tensor]], list[np.ndarray], set]:
    """Per output (in order): {site: rows} and the positions, read from the sink shards
    not in `seen` (files read before); returns them and the files seen now. A
    position written twice (a preempted request's recomputation) keeps its last row, as
    the per-request path does."""
    index = sink_index(llm)
    if index is None:
        raise RuntimeError("harvest: the engine's sink disappeared")
    root = Path(index["root"])
    shards = [s for s in index["shards"] if s["file"] not in seen]  # each site's in order
    from safetensors.torch import load_file

    # the engine core's request ids: vLLM appends "-" and 8 hex digits to each output's
    owner = {r.rsplit("-", 1)[0]: i for i, r in enumerate(index["requests"])}
    wanted = {}
    for i, o in enumerate(outs):
        if o.request_id not in owner:
            raise RuntimeError(f"harvest: prompt {first + i}: no rows reached the sink")
        wanted[owner[o.request_id]] = i
    per_out: list[dict[str, torch.Tensor]] = [{} for _ in outs]
    positions: list[np.ndarray | None] = [None] * len(outs)
    for site in sites:
        files = [load_file(str(root / s["file"])) for s in shards if s["site"] == site]
        if not files:
            raise RuntimeError(f"harvest: no sink rows of {site}")
        request = torch.cat([f["request"] for f in files]).numpy()
        position = torch.cat([f["position"] for f in files]).numpy()
        values = torch.cat([f["values"] for f in files])
        # by request, then position, later rows last: the last of a repeated position wins
        order = np.lexsort((np.arange(len(position)), position, request))
        request, position = request[order], position[order]
        keep = np.ones(len(order), bool)
        keep[:-1] = (request[1:] != request[:-1]) | (position[1:] != position[:-1])
        order, request, position = order[keep], request[keep], position[keep]
        mine = sorted(wanted)
        bounds = np.searchsorted(request, mine, side="left")
        ends = np.searchsorted(request, mine, side="right")
        for r, lo, hi in zip(mine, bounds, ends):
            i = wanted[r]
            if positions[i] is None:
                positions[i] = position[lo:hi]
            elif not np.array_equal(positions[i], position[lo:hi]):
                raise RuntimeError(f"harvest: prompt {first + i}: {site} came back at other "
                                   f"positions than {sites[0]}")
            per_out[i][site] = values[torch.from_numpy(order[lo:hi])]
    for s in shards:
        (root / s["file"]).unlink(missing_ok=True)
    return per_out, positions, seen | {s["file"] for s in shards}
