"""Runtime guards, in the worker as each step's rows arrive on the host (after the copy,
on the output thread: never on the step's critical path): a request whose stopping guard
flags gets the FINISH key in the step's chunk (its payload's `finish`), on which vLLM's
scheduler finishes it (finish_reason "guard", patch 0007). The verdict a request returns (the first flagged
row, else the extreme score) is the frontend's, from the rows it returns (assemble.py):
nothing per step travels for it."""
from __future__ import annotations

import numpy as np
import torch

from graphtap.courier.chunks import FINISH, positions_key
from graphtap.courier.pack import unpack


def verdict(guard, prompt_len: int, chunk: dict[str, torch.Tensor]):
    """(score, position, flagged) of this step's rows of the request, or None when the
    step holds none the guard reads. Runs per guarded request per step, so in numpy on
    the tensors' memory (a handful of torch calls cost ~20 us a request: 2 % of a decode
    step at 16 requests, on the thread that shares the GIL with the next step's setup)."""
    chunk = unpack(chunk)  # attention masses come packed (pack.py)
    if guard.kind == "attention_focus":
        last = prompt_len - 1
        focus = []
        for name in guard.sources:
            pos = chunk.get(positions_key(name))
            if pos is None:
                return None
            at = np.flatnonzero(pos.numpy() == last)
            if not len(at):
                return None
            mass = chunk[name][int(at[-1])].float().numpy()  # [heads, spans]
            focus.append(mass[:, 0] / np.maximum(mass[:, 0] + mass[:, 1], 1e-30))
        score = float(np.concatenate(focus).mean())
        return score, last, score < guard.threshold
    name = guard.sources[0]
    pos = chunk.get(positions_key(name))
    if pos is None:
        return None
    pos = pos.numpy()
    if len(pos) == 1:  # a decode step: one row
        position = int(pos[0])
        if position < prompt_len:
            return None
        score = float(chunk[name].numpy()[0, guard.column])
        return score, position, score > guard.threshold
    generated = pos >= prompt_len
    if not generated.any():
        return None
    scores = chunk[name].numpy()[generated, guard.column]  # float32 rows (probe scores)
    where = np.flatnonzero(scores > guard.threshold)
    i = int(where[0]) if len(where) else int(scores.argmax())
    return float(scores[i]), int(pos[generated][i]), bool(len(where))


def apply_guards(out: dict[str, dict[str, torch.Tensor]], guards: dict) -> None:
    """Add FINISH to the chunk of each request whose stopping guard flags its rows."""
    for req, (guard, prompt_len) in guards.items():
        chunk = out.get(req)
        if not chunk or not guard.stop:
            continue
        found = verdict(guard, prompt_len, chunk)
        if found is not None and found[2]:
            chunk[FINISH] = torch.ones(1, dtype=torch.int8)


def outcome(guard, prompt_len: int, rows: dict) -> dict:
    """A finished request's verdict from the rows it returns (name and positions_key
    -> tensor): the first flagged row, else the extreme score; None without rows."""
    found = verdict(guard, prompt_len, rows)
    if found is None:
        return {"score": None, "position": None, "flagged": False}
    score, position, flagged = found
    return {"score": score, "position": position, "flagged": bool(flagged)}
