"""Runtime guards, evaluated in the worker as each step's rows arrive on the host (after
the copy, on the output thread: never on the step's critical path): a flagged request
gets its verdict in the step's chunk, and with "stop" the FINISH key, on which vLLM's
scheduler finishes it (finish_reason "guard", patch 0007). The frontend keeps the
decisive verdict: the first flagged one, else the extreme score seen."""
from __future__ import annotations

import torch

from graphtap.courier.chunks import FINISH, GUARD, positions_key


def verdict(guard, prompt_len: int, chunk: dict[str, torch.Tensor]):
    """(score, position, flagged) of this step's rows of the request, or None when the
    step holds none the guard reads."""
    if guard.kind == "attention_focus":
        last = prompt_len - 1
        focus = []
        for name in guard.sources:
            pos = chunk.get(positions_key(name))
            if pos is None:
                return None
            at = (pos == last).nonzero()
            if not len(at):
                return None
            mass = chunk[name][int(at[-1])].float()  # [heads, spans]
            focus.append(mass[:, 0] / (mass[:, 0] + mass[:, 1]).clamp_min(1e-30))
        score = float(torch.cat(focus).mean())
        return score, last, score < guard.threshold
    name = guard.sources[0]
    pos = chunk.get(positions_key(name))
    if pos is None:
        return None
    generated = pos >= prompt_len
    if not bool(generated.any()):
        return None
    scores = chunk[name][generated, guard.column].float()
    where = (scores > guard.threshold).nonzero()
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
        chunk[GUARD] = torch.tensor([score, float(position), float(flagged)],
                                    dtype=torch.float64)
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
