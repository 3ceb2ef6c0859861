"""Request hook specs: validation with clear errors, normalisation, and the cache salt.

A user writes (in `SamplingParams.hooks`, or as a JSON string in `extra_args["hooks"]` /
`vllm_xargs` over HTTP):

    {"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "vector": [...],
                "scale": 4.0, "positions": "all"}]}

The frontend turns it into a normalised, data-only form for the worker: vectors become
float32 bytes with a content key, ops become the three numbers the graph op needs.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from graphtap.sites import parse_site

FORMAT = 1
OPS = ("add", "set_projection", "ablate", "clamp")


class PositionRange(BaseModel):
    """Positions start <= p < end (end exclusive, like a Python slice)."""

    model_config = ConfigDict(extra="forbid")
    start: int = Field(ge=0)
    end: int = Field(gt=0)

    @model_validator(mode="after")
    def _ordered(self):
        if self.end <= self.start:
            raise ValueError(f"end ({self.end}) must be greater than start ({self.start})")
        return self


NAMED_POSITIONS = ("all", "prompt", "generated", "last_prompt")


def _parse_positions(p: Any):
    """Dispatch on the JSON type, so an error speaks about the form the user chose."""
    if isinstance(p, str):
        if p not in NAMED_POSITIONS:
            raise ValueError(f"{p!r} is not one of {', '.join(NAMED_POSITIONS)}")
        return p
    if isinstance(p, dict) or isinstance(p, PositionRange):
        return PositionRange.model_validate(p)
    if isinstance(p, list):
        if not p:
            raise ValueError("an empty list selects nothing")
        bad = next((x for x in p if isinstance(x, bool) or not isinstance(x, int) or x < 0), None)
        if bad is not None:
            raise ValueError(f"positions must be integers >= 0, got {bad!r}")
        return list(p)
    raise ValueError("expected a name, a list of positions or {\"start\": s, \"end\": e}")


class Steer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    site: str
    op: Literal["add", "set_projection", "ablate", "clamp"]
    vector: list[float] = Field(min_length=1)
    scale: float = 1.0
    target: float | None = None
    min: float | None = None
    max: float | None = None
    positions: Any = "all"

    @field_validator("positions", mode="before")
    @classmethod
    def _positions(cls, p: Any):
        return _parse_positions(p)

    @field_validator("vector")
    @classmethod
    def _finite(cls, v: list[float]) -> list[float]:
        bad = next((i for i, x in enumerate(v) if not math.isfinite(x)), None)
        if bad is not None:
            raise ValueError(f"element {bad} is {v[bad]}: vectors must be finite")
        return v

    @field_validator("scale", "target", "min", "max")
    @classmethod
    def _finite_number(cls, x: float | None) -> float | None:
        if x is not None and not math.isfinite(x):
            raise ValueError(f"must be finite, got {x}")
        return x

    @model_validator(mode="after")
    def _op_fields(self):
        if self.op == "set_projection" and self.target is None:
            raise ValueError("op 'set_projection' needs 'target'")
        if self.op == "clamp":
            if self.min is None or self.max is None:
                raise ValueError("op 'clamp' needs 'min' and 'max'")
            if self.min > self.max:
                raise ValueError(f"clamp min ({self.min}) is greater than max ({self.max})")
        if self.op in ("set_projection", "ablate", "clamp") and not any(self.vector):
            raise ValueError(f"op {self.op!r} needs a non-zero vector (it projects on it)")
        return self


class Capture(BaseModel):
    model_config = ConfigDict(extra="forbid")

    site: str
    positions: Any = "all"
    dtype: Literal["model", "float32"] = "model"
    heads: list[int] | None = Field(None, min_length=1)
    """Attention sites only: which heads (q, z and pattern: query heads; k and v: KV
    heads). Default: all."""

    @field_validator("positions", mode="before")
    @classmethod
    def _positions(cls, p: Any):
        return _parse_positions(p)


class HookSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steer: list[Steer] = Field(default_factory=list)
    capture: list[Capture] = Field(default_factory=list)
    save_to: str | None = None
    """Directory for one safetensors file per request (written by the frontend)."""


class ModelShape(BaseModel):
    """What validation needs to know about the served model and engine."""

    num_layers: int
    hidden_size: int
    max_model_len: int
    configured_sites: set[str]
    max_steers: int
    max_vectors: int
    max_captures: int = 8
    num_heads: int = 0
    num_kv_heads: int = 0
    save_root: str | None = None


def _loc(loc: tuple) -> str:
    out = "hooks"
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _pydantic_error(e: ValidationError) -> ValueError:
    err = e.errors()[0]
    loc = err["loc"]
    msg = err["msg"].removeprefix("Value error, ")
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return ValueError(f"{_loc(loc)}: {msg}{more}")


def parse_spec(raw: Any) -> HookSpec:
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"hooks: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"hooks: expected an object, got {type(raw).__name__}")
    try:
        return HookSpec.model_validate(raw)
    except ValidationError as e:
        raise _pydantic_error(e) from None


def _vector_key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


# Projection bounds [lo, hi] per op: the graph op sets <h, v_hat> to clamp(<h, v_hat>, lo, hi).
def _bounds(s: Steer) -> tuple[float, float, float]:
    """(a, lo, hi): delta = a * v + (clamp(p, lo, hi) - p) * v_hat, with p = <h, v_hat>."""
    inf = math.inf
    if s.op == "add":
        return s.scale, -inf, inf
    if s.op == "set_projection":
        return 0.0, s.target, s.target
    if s.op == "ablate":
        return 0.0, 0.0, 0.0
    return 0.0, s.min, s.max


def _positions(p, field: str, max_len: int):
    if isinstance(p, str):
        return p
    if isinstance(p, PositionRange):
        if p.start >= max_len:
            raise ValueError(f"{field}.positions.start: {p.start} is beyond "
                             f"max_model_len {max_len}")
        return {"start": p.start, "end": min(p.end, max_len)}
    bad = [x for x in p if x >= max_len]
    if bad:
        raise ValueError(f"{field}.positions: {bad[0]} is beyond max_model_len {max_len}")
    return sorted(set(p))


def _site(name: str, field: str, shape: ModelShape):
    try:
        site = parse_site(name, shape.num_layers)
    except ValueError as e:
        raise ValueError(f"{field}.site: {e}") from None
    if site.name not in shape.configured_sites:
        raise ValueError(f"{field}.site: {site.name} has no op in this engine; "
                         f"add it to hook_config.sites")
    return site


def _heads(heads, site, i: int, shape: ModelShape):
    if heads is None:
        return None
    if site.is_residual:
        raise ValueError(f"hooks.capture[{i}].heads: {site.name} has no heads")
    count = shape.num_kv_heads if site.kind in ("attn_k", "attn_v") else shape.num_heads
    bad = [h for h in heads if not 0 <= h < count]
    if bad:
        raise ValueError(f"hooks.capture[{i}].heads: head {bad[0]} is out of range: "
                         f"{site.name} has {count} heads (0..{count - 1})")
    return sorted(set(heads))


def normalise(spec: HookSpec, shape: ModelShape) -> dict:
    """Check against the model and engine; return the worker's data-only form."""
    if len(spec.steer) > shape.max_steers:
        raise ValueError(f"hooks.steer: {len(spec.steer)} steers, more than the engine's "
                         f"{shape.max_steers} per request (hook_config.max_steers)")
    steers = []
    for i, s in enumerate(spec.steer):
        site = _site(s.site, f"hooks.steer[{i}]", shape)
        if not site.is_residual:
            raise ValueError(f"hooks.steer[{i}].site: steering acts on the residual stream "
                             f"(hook_resid_pre|mid|post); {site.name} can be captured only")
        if len(s.vector) != shape.hidden_size:
            raise ValueError(f"hooks.steer[{i}].vector: length {len(s.vector)}, the model's "
                             f"hidden size is {shape.hidden_size}")
        data = np.asarray(s.vector, dtype=np.float32)
        if not np.isfinite(data).all():
            raise ValueError(f"hooks.steer[{i}].vector: overflows float32")
        raw = data.tobytes()
        a, lo, hi = _bounds(s)
        steers.append({"layer": site.layer, "kind": site.kind, "vector": raw,
                       "key": _vector_key(raw), "a": a, "lo": lo, "hi": hi,
                       "positions": _positions(s.positions, f"hooks.steer[{i}]",
                                               shape.max_model_len)})
    keys = {s["key"] for s in steers}
    if len(keys) > shape.max_vectors:
        raise ValueError(f"hooks.steer: {len(keys)} distinct vectors, more than the engine's "
                         f"resident table of {shape.max_vectors} (hook_config.max_vectors)")
    if len(spec.capture) > shape.max_captures:
        raise ValueError(f"hooks.capture: {len(spec.capture)} captures, more than the engine's "
                         f"{shape.max_captures} per request (hook_config.max_captures)")
    captures, seen = [], set()
    for i, c in enumerate(spec.capture):
        site = _site(c.site, f"hooks.capture[{i}]", shape)
        if site in seen:
            raise ValueError(f"hooks.capture[{i}].site: {site.name} is captured twice; "
                             f"merge the positions into one entry")
        seen.add(site)
        captures.append({"layer": site.layer, "kind": site.kind, "name": site.name,
                         "dtype": c.dtype, "heads": _heads(c.heads, site, i, shape),
                         "positions": _positions(c.positions, f"hooks.capture[{i}]",
                                                 shape.max_model_len)})
    return {"format": FORMAT, "steer": steers, "capture": captures,
            "save_to": _save_to(spec.save_to, shape.save_root, bool(captures))}


def _save_to(save_to: str | None, root: str | None, captures: bool) -> str | None:
    """The directory, resolved inside the engine's save_root, or a clear refusal."""
    import os

    if save_to is None:
        return None
    if not captures:
        raise ValueError("hooks.save_to: nothing is captured, so nothing would be saved")
    if root is None:
        raise ValueError("hooks.save_to: this engine has no hook_config.save_root, so "
                         "requests may not write files")
    base = os.path.realpath(root)
    path = os.path.realpath(os.path.join(base, save_to))
    if os.path.commonpath([base, path]) != base:
        raise ValueError(f"hooks.save_to: {save_to!r} is outside hook_config.save_root")
    return path


def steering_salt(normalised: dict) -> str | None:
    """Content hash of everything that changes the KV cache, or None when nothing does.
    A content hash, never a name: EasySteer's name-keyed cache reused stale steering."""
    steer = normalised.get("steer") or []
    if not steer:
        return None
    h = hashlib.sha256(b"graphtap-steer-v1")
    for s in steer:
        h.update(json.dumps([s["layer"], s["kind"], s["key"], s["a"], s["lo"], s["hi"],
                             s["positions"]], default=str).encode())
    return h.hexdigest()[:32]
