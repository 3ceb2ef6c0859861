"""A finished request's hook outputs, from the chunks its steps sent (frontend process):
rows in position order, the last row kept where a position ran twice (recomputation
after preemption), patterns unpacked, an overflow as the error. The request's
safetensors file, where it asked for one, is save.py's."""
from __future__ import annotations

import torch

from graphtap.courier.chunks import (ERROR, HELD, OVERFLOW, Overflow, error_message,
                                     is_data_key, positions_key, ragged_name)
from graphtap.courier.guard import outcome
from graphtap.courier.pack import unpack
from graphtap.courier.patterns import unpack_patterns
from graphtap.courier.payload import own, owns
from graphtap.outputs import HookOutputs


def merge_chunks(chunks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate per-key pieces along the first dimension, in arrival order (packs
    split per site first)."""
    names: dict[str, list[torch.Tensor]] = {}
    for chunk in chunks:
        for name, tensor in unpack(chunk).items():
            names.setdefault(name, []).append(tensor)
    return {n: t[0] if len(t) == 1 else torch.cat(t) for n, t in names.items()}


def assemble(chunks: list[dict[str, torch.Tensor]], guard=None, prompt_len: int = 0,
             held_through: int | None = None) -> HookOutputs:
    """`guard`: the request's GuardEntry, when it has one (its verdict is computed from
    the rows returned). `held_through`: where the request held rows on the worker
    (courier/held.py), the positions its last held chunk must cover (its length - 1)."""
    merged = merge_chunks(chunks)
    if ERROR in merged:
        return HookOutputs(error=error_message(merged[ERROR]))
    if OVERFLOW in merged:
        return HookOutputs(error=Overflow.from_tensor(merged[OVERFLOW]).message())  # the first
    if held_through is not None:
        came = int(merged[HELD].max()) if HELD in merged else 0
        if came < held_through:
            return HookOutputs(error=(
                f"hooks: the request ended at a step the worker did not see coming (an "
                f"abort, or a finish decided outside vLLM's stop checks): its rows held on "
                f"the worker came home through position {came - 1} of {held_through - 1}, "
                f"and its outputs were withheld rather than returned incomplete"))
    out = HookOutputs()
    within = 0  # the request's values' bytes, which views may share (payload.own)
    for key in merged:
        if (name := ragged_name(key)) is not None:
            pos = merged[positions_key(name)]
            rows = unpack_patterns(merged[key], pos)
        elif is_data_key(key):
            name, rows, pos = key, merged[key], merged[positions_key(key)]
        else:
            continue
        if len(pos) > 1 and not bool((pos[1:] > pos[:-1]).all()):
            # Out of order or repeated: only after recomputation (preemption) or
            # chunks arriving out of step order. A gather copies every row, so the
            # usual, ordered case skips it (merge_chunks copied them already).
            order = torch.argsort(pos, stable=True)
            rows, pos = rows[order], pos[order]
            keep = torch.ones_like(pos, dtype=torch.bool)
            keep[:-1] = pos[1:] != pos[:-1]  # the last of equal positions wins
            rows, pos = rows[keep], pos[keep]
        if not within and not (owns(rows) and owns(pos)):  # summed only where needed
            within = sum(t.nbytes for t in merged.values())
        out[name], out.positions[name] = own(rows, within), own(pos, within)
    if guard is not None:
        rows = {k: v for name in guard.sources if name in out
                for k, v in ((name, out[name]), (positions_key(name), out.positions[name]))}
        out.guard = {"kind": guard.kind, "threshold": guard.threshold,
                     "action": "stop" if guard.stop else "annotate",
                     **outcome(guard, prompt_len, rows)}
    return out
