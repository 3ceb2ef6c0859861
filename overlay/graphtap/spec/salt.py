"""The prefix-cache salt of a normalised spec."""
from __future__ import annotations

import hashlib
import json

import msgspec

from graphtap.spec.entries import NormalisedSpec


def steering_salt(spec: NormalisedSpec) -> str | None:
    """Content hash of everything that changes the KV cache, or None when nothing does.
    A content hash, never a name: EasySteer's name-keyed cache reused stale steering."""
    if not spec.steer:
        return None
    h = hashlib.sha256(b"graphtap-steer-v1")
    for s in spec.steer:
        h.update(json.dumps([s.layer, s.kind, s.key, s.a, s.lo, s.hi,
                             msgspec.to_builtins(s.positions)]).encode())
    return h.hexdigest()[:32]


def combined_salt(user_salt: str | None, spec: NormalisedSpec) -> str | None:
    """The request's cache salt: the user's, with the steering's appended."""
    salt = steering_salt(spec)
    if salt is None:
        return user_salt
    return f"{user_salt}|graphtap:{salt}" if user_salt else f"graphtap:{salt}"
