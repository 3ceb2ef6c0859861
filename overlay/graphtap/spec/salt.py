"""The prefix-cache salt of a normalised spec."""
from __future__ import annotations

import hashlib
import json

import msgspec

from graphtap.spec.entries import NormalisedSpec


RELATIVE = ("prompt", "generated", "last_prompt")  # rules whose positions depend on the prompt


def steering_salt(spec: NormalisedSpec, prompt_len: int = 0) -> str | None:
    """Content hash of everything that changes the KV cache, or None when nothing does.
    A content hash, never a name: EasySteer's name-keyed cache reused stale steering.
    Rules relative to the prompt steer different positions for different prompt lengths,
    so their blocks of a shared prefix differ: the length is part of their hash."""
    if not spec.steer:
        return None
    h = hashlib.sha256(b"graphtap-steer-v2")
    for s in spec.steer:
        c = s.condition  # the gate decides what the KV holds: its whole definition
        h.update(json.dumps([s.layer, s.kind, s.key, s.a, s.lo, s.hi, s.g,
                             msgspec.to_builtins(s.positions),
                             None if c is None else [c.layer, c.kind, c.key, c.threshold,
                                                     c.unit, c.bias, c.sigmoid, c.below]]
                            ).encode())
    if any(s.positions in RELATIVE for s in spec.steer):
        h.update(f"prompt_len={prompt_len}".encode())
    return h.hexdigest()[:32]


MEMO = 64  # steering salts a memo keeps (prompt lengths of a relative rule)


def combined_salt(user_salt: str | None, spec: NormalisedSpec, prompt_len: int = 0,
                  memo: dict | None = None) -> str | None:
    """The request's cache salt, in two namespaces no user string can cross: a user's own
    salt becomes "user:<salt>", a steered request's "graphtap:<hash>" (then its user's).
    A plain request without a salt keeps none, as in stock vLLM. `memo`: steering salts
    of this very spec already made (the frontend keeps one per distinct spec: hashing a
    steering spec was a third of its admission), by the prompt length where a rule is
    relative to the prompt."""
    if memo is None or not spec.steer:
        salt = steering_salt(spec, prompt_len)
    else:
        at = prompt_len if any(x.positions in RELATIVE for x in spec.steer) else 0
        salt = memo.get(at)
        if salt is None:
            if len(memo) >= MEMO:
                memo.clear()
            salt = memo[at] = steering_salt(spec, prompt_len)
    user = None if user_salt is None else f"user:{user_salt}"
    if salt is None:
        return user
    return f"graphtap:{salt}" + (f"|{user}" if user else "")
