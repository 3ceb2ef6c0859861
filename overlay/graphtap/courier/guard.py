"""Runtime guards, evaluated in the worker as each step's rows arrive on the host (after
the copy, on the output thread: never on the step's critical path): a flagged request
gets its verdict in the step's chunk, and with "stop" the FINISH key, on which vLLM's
scheduler finishes it (finish_reason "guard", patch 0007). The frontend keeps the
decisive verdict: the first flagged one, else the extreme score seen."""
from __future__ import annotations

import numpy as np
import torch

from graphtap.courier.chunks import FINISH, GUARD, positions_key


def verdict(guard, prompt_len: int, chunk: dict[str, torch.Tensor]):
    """(score, position, flagged) of this step's rows of the request, or None when the
    step holds none the guard reads. Runs per guarded request per step, so in numpy on
    the tensors' memory (a handful of torch calls cost ~20 us a request: 2 % of a decode
    step at 16 requests, on the thread that shares the GIL with the next step's setup)."""
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
    """Add each guarded request's verdict (and FINISH where it stops) to its chunk."""
    for req, (guard, prompt_len) in guards.items():
        chunk = out.get(req)
        if not chunk:
            continue
        found = verdict(guard, prompt_len, chunk)
        if found is None:
            continue
        score, position, flagged = found
        chunk[GUARD] = torch.from_numpy(np.array([score, position, flagged], np.float64))
        if flagged and guard.stop:
            chunk[FINISH] = torch.ones(1, dtype=torch.int8)


def decisive(rows: torch.Tensor, kind: str) -> dict:
    """The request's verdict from its steps' [score, position, flagged] rows."""
    flagged = rows[:, 2] > 0
    if bool(flagged.any()):
        i = int(rows[flagged, 1].argmin())
        row = rows[flagged][i]
    else:  # the extreme: lowest focus, highest probe score
        row = rows[int(rows[:, 0].argmin() if kind == "attention_focus" else rows[:, 0].argmax())]
    return {"score": float(row[0]), "position": int(row[1]), "flagged": bool(row[2] > 0)}
