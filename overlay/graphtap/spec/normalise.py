"""A parsed spec checked against the served model and engine, and turned into typed
entries (`NormalisedSpec`): vectors become float32 bytes with a content key, each steer op
the three numbers the graph op needs, and each capture goes to the family of its site."""
from __future__ import annotations

import hashlib
import math
import re

import numpy as np
from pydantic import BaseModel

from graphtap.spec.entries import CaptureEntry, NormalisedSpec, PatternEntry, Span, SteerEntry
from graphtap.spec.registry import VectorRegistry
from graphtap.spec.schema import HookSpec, PositionRange, Steer, short
from graphtap.spec.sites import KV_HEAD_KINDS, Site, parse_site


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
    max_response_rows: int = 65536
    dtype: str = "float32"  # the model's: steering arithmetic must stay finite in it
    head_dim: int = 0
    max_response_bytes: int = 256 * 2**20
    max_live_capture_bytes: int = 2 * 2**30
    save_quota_bytes: int = 16 * 2**30


def steer_bounds(s: Steer) -> tuple[float, float, float]:
    """(a, lo, hi): delta = a * v + (clamp(p, lo, hi) - p) * v_hat, with p = <h, v_hat>."""
    inf = math.inf
    if s.op == "add":
        return s.scale, -inf, inf
    if s.op == "set_projection":
        return 0.0, s.target, s.target
    if s.op == "ablate":
        return 0.0, 0.0, 0.0
    return 0.0, s.min, s.max


def vector_key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def _positions(p, field: str, max_len: int):
    if isinstance(p, str):
        return p
    if isinstance(p, PositionRange):
        if p.start >= max_len:
            raise ValueError(f"{field}.positions.start: {p.start} is beyond "
                             f"max_model_len {max_len}")
        return Span(p.start, min(p.end, max_len))
    bad = [x for x in p if x >= max_len]
    if bad:
        raise ValueError(f"{field}.positions: {bad[0]} is beyond max_model_len {max_len}")
    return tuple(sorted(set(p)))


def _site(name: str, field: str, shape: ModelShape) -> Site:
    try:
        site = parse_site(name, shape.num_layers)
    except ValueError as e:
        raise ValueError(f"{field}.site: {e}") from None
    if site.name not in shape.configured_sites:
        raise ValueError(f"{field}.site: {site.name} has no op in this engine; "
                         f"add it to hook_config.sites")
    return site


def _heads(heads, site: Site, i: int, shape: ModelShape) -> tuple[int, ...] | None:
    if heads is None:
        return None
    if site.is_residual:
        raise ValueError(f"hooks.capture[{i}].heads: {site.name} has no heads")
    count = shape.num_kv_heads if site.kind in KV_HEAD_KINDS else shape.num_heads
    bad = [h for h in heads if not 0 <= h < count]
    if bad:
        raise ValueError(f"hooks.capture[{i}].heads: head {bad[0]} is out of range: "
                         f"{site.name} has {count} heads (0..{count - 1})")
    return tuple(sorted(set(heads)))


# The largest finite value of each model dtype; a request's steering at one position is
# kept below 1/16 of it, so that the stream it edits (and the KV cache made from it)
# stays finite: an inf there turns into NaN downstream (inf * 0, inf - inf) and reaches
# other requests through reused cache blocks.
DTYPE_MAX = {"float32": 3.4028235e38, "bfloat16": 3.3895314e38, "float16": 65504.0}
HEADROOM = 1 / 16


def _float32(x: float | None, field: str) -> None:
    if x is not None and math.isfinite(x) and abs(x) > DTYPE_MAX["float32"]:
        raise ValueError(f"{field}: {x} overflows float32, the precision of the steering "
                         f"tables")


def _magnitude(s: Steer, data: bytes, i: int, shape: ModelShape) -> float:
    """What this steer can add at a position, at most: |a| max|v|, or a bound it sets."""
    peak = float(np.abs(np.frombuffer(data, np.float32)).max())
    dtype_max = DTYPE_MAX.get(shape.dtype, DTYPE_MAX["float32"])
    if peak > dtype_max:
        raise ValueError(f"hooks.steer[{i}].vector: a value of {peak:g} overflows the "
                         f"model's {shape.dtype}")
    a, lo, hi = steer_bounds(s)
    return abs(a) * peak + max((abs(x) for x in (lo, hi) if math.isfinite(x)), default=0.0)


def _vector(s: Steer, i: int, shape: ModelShape, vectors: VectorRegistry | None) -> bytes:
    """A steer's vector as float32 bytes: its values, or the registered vector it names."""
    if isinstance(s.vector, str):
        named = vectors.get(s.vector) if vectors is not None else None
        if named is None:
            raise ValueError(f"hooks.steer[{i}].vector: no registered vector named "
                             f"{short(s.vector)} (GET /v1/graphtap/vectors lists them)")
        if s.op != "add" and named.norm == 0:
            raise ValueError(f"hooks.steer[{i}]: op {s.op!r} needs a non-zero vector "
                             f"(it projects on it); {short(s.vector)} is zero")
        return named.data
    if len(s.vector) != shape.hidden_size:
        raise ValueError(f"hooks.steer[{i}].vector: length {len(s.vector)}, the model's "
                         f"hidden size is {shape.hidden_size}")
    data = np.asarray(s.vector, dtype=np.float32)
    if not np.isfinite(data).all():
        raise ValueError(f"hooks.steer[{i}].vector: overflows float32")
    return data.tobytes()


def _steers(spec: HookSpec, shape: ModelShape,
            vectors: VectorRegistry | None) -> tuple[SteerEntry, ...]:
    if len(spec.steer) > shape.max_steers:
        raise ValueError(f"hooks.steer: {len(spec.steer)} steers, more than the engine's "
                         f"{shape.max_steers} per request (hook_config.max_steers)")
    steers, reach = [], 0.0
    dtype_max = DTYPE_MAX.get(shape.dtype, DTYPE_MAX["float32"])
    for i, s in enumerate(spec.steer):
        for name in ("scale", "target", "min", "max"):
            _float32(getattr(s, name), f"hooks.steer[{i}].{name}")
        site = _site(s.site, f"hooks.steer[{i}]", shape)
        if not site.is_residual:
            raise ValueError(f"hooks.steer[{i}].site: steering acts on the residual stream "
                             f"(hook_resid_pre|mid|post); {site.name} can be captured only")
        raw = _vector(s, i, shape, vectors)
        reach += _magnitude(s, raw, i, shape)
        if reach > dtype_max * HEADROOM:
            raise ValueError(f"hooks.steer[{i}]: this request's steering reaches {reach:g} at "
                             f"a position, past 1/16 of the largest {shape.dtype} "
                             f"({dtype_max:g}): the stream would overflow")
        a, lo, hi = steer_bounds(s)
        steers.append(SteerEntry(site.layer, site.kind, raw, vector_key(raw), a, lo, hi,
                                 _positions(s.positions, f"hooks.steer[{i}]",
                                            shape.max_model_len)))
    keys = {s.key for s in steers}
    if len(keys) > shape.max_vectors:
        raise ValueError(f"hooks.steer: {len(keys)} distinct vectors, more than the engine's "
                         f"resident table of {shape.max_vectors} (hook_config.max_vectors)")
    return tuple(steers)


def _captures(spec: HookSpec, shape: ModelShape):
    if len(spec.capture) > shape.max_captures:
        raise ValueError(f"hooks.capture: {len(spec.capture)} captures, more than the engine's "
                         f"{shape.max_captures} per request (hook_config.max_captures)")
    rows, patterns, seen = [], [], set()
    for i, c in enumerate(spec.capture):
        site = _site(c.site, f"hooks.capture[{i}]", shape)
        if site in seen:
            raise ValueError(f"hooks.capture[{i}].site: {site.name} is captured twice; "
                             f"merge the positions into one entry")
        seen.add(site)
        heads = _heads(c.heads, site, i, shape)
        positions = _positions(c.positions, f"hooks.capture[{i}]", shape.max_model_len)
        if site.capture_family == "pattern":
            patterns.append(PatternEntry(site.layer, site.name, c.dtype,
                                         heads or tuple(range(shape.num_heads)), positions))
        else:
            rows.append(CaptureEntry(site.layer, site.kind, site.name, c.dtype, heads,
                                     positions))
    return tuple(rows), tuple(patterns)


def normalise(spec: HookSpec, shape: ModelShape,
              vectors: VectorRegistry | None = None) -> NormalisedSpec:
    """Check against the model and engine (and the frontend's registered vectors);
    return the worker's data-only form."""
    steers = _steers(spec, shape, vectors)
    captures, patterns = _captures(spec, shape)
    return NormalisedSpec(steer=steers, capture=captures, pattern=patterns,
                          save_to=_save_to(spec.save_to, shape.save_root,
                                           bool(captures or patterns)),
                          encoding=spec.encoding)


SAVE_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SAVE_DEPTH = 8


def _save_to(save_to: str | None, root: str | None, captures: bool) -> str | None:
    """The directory, resolved inside the engine's save_root, or a clear refusal. A plain
    relative path: at most 8 names of letters, digits, '.', '_' and '-', each starting
    with a letter or digit (no '~', '..', absolute paths or empty names)."""
    if save_to is None:
        return None
    segments = save_to.split("/") if isinstance(save_to, str) else []
    if not segments or len(segments) > SAVE_DEPTH or \
            not all(SAVE_SEGMENT.fullmatch(seg) for seg in segments):
        raise ValueError(f"hooks.save_to: {short(save_to)} is not a plain relative folder "
                         f"(at most {SAVE_DEPTH} names of 1-64 letters, digits, '.', '_', "
                         f"'-', each starting with a letter or digit)")
    if not captures:
        raise ValueError("hooks.save_to: nothing is captured, so nothing would be saved")
    if root is None:
        raise ValueError("hooks.save_to: this engine has no hook_config.save_root, so "
                         "requests may not write files")
    return save_to  # relative: the frontend's saver walks it from save_root (no links)
