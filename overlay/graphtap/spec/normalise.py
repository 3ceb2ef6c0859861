"""A parsed spec checked against the served model and engine, and turned into typed
entries (`NormalisedSpec`): vectors become float32 bytes with a content key, each steer op
the three numbers the graph op needs, and each capture goes to the family of its site."""
from __future__ import annotations

import math
import re

import numpy as np

from graphtap.spec import scores
from graphtap.spec.condition import condition_entry
from graphtap.spec.entries import CaptureEntry, NormalisedSpec, PatternEntry, SteerEntry
from graphtap.spec.packed import values_of
from graphtap.spec.registry import VectorRegistry
from graphtap.spec.schema import HookSpec, Steer, short
from graphtap.spec.shape import (DTYPE_MAX, HEADROOM, ModelShape, check_float32,
                                 hidden_vector, rule_of, site_of, vector_key)
from graphtap.spec.sites import KV_HEAD_KINDS, Site


def steer_bounds(s: Steer) -> tuple[float, float, float]:
    """(a, lo, hi): delta = a * v + (clamp(p, lo, hi) - p) * v_hat, with p = <h, v_hat>
    ("scale" is g = scale - 1 on the elements its mask selects: steer_gain)."""
    inf = math.inf
    if s.op == "scale":
        return 0.0, -inf, inf
    if s.op == "add":
        return s.scale, -inf, inf
    if s.op == "set_projection":
        return 0.0, s.target, s.target
    if s.op == "ablate":
        return 0.0, 0.0, 0.0
    return 0.0, s.min, s.max


def steer_gain(s: Steer) -> float:
    """g of delta's g * (v * h) term: "scale" multiplies the masked elements by scale."""
    return s.scale - 1.0 if s.op == "scale" else 0.0


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


def _magnitude(s: Steer, data: bytes, i: int, shape: ModelShape) -> float:
    """What this steer can add at a position, at most: |a| max|v|, or a bound it sets."""
    if s.op == "scale":  # a mask: what it adds is bounded by MAX_HEAD_SCALE times z
        return 0.0
    peak = float(np.abs(np.frombuffer(data, np.float32)).max())
    dtype_max = DTYPE_MAX.get(shape.dtype, DTYPE_MAX["float32"])
    if peak > dtype_max:
        raise ValueError(f"hooks.steer[{i}].vector: a value of {peak:g} overflows the "
                         f"model's {shape.dtype}")
    a, lo, hi = steer_bounds(s)
    return abs(a) * peak + max((abs(x) for x in (lo, hi) if math.isfinite(x)), default=0.0)


def _head_vector(s: Steer, i: int, shape: ModelShape,
                 vectors: VectorRegistry | None) -> bytes:
    """At attn.hook_z, the row-wide vector of a head edit (float32 bytes over heads x
    head_dim): "scale" a mask of the chosen heads; "add" its vector in each chosen head,
    or a whole z row without heads."""
    width, d = shape.num_heads * shape.head_dim, shape.head_dim
    heads = _steer_heads(s, i, shape)
    row = np.zeros((shape.num_heads, d), np.float32)
    if s.op == "scale":
        row[list(heads)] = 1.0
        return row.tobytes()
    want = d if heads else width
    if isinstance(s.vector, str):
        named = vectors.get(s.vector) if vectors is not None else None
        if named is None:
            raise ValueError(f"hooks.steer[{i}].vector: no registered vector named "
                             f"{short(s.vector)} (GET /v1/graphtap/vectors lists them)")
        values = np.frombuffer(named.data, np.float32)
    else:
        values = values_of(s.vector)
    if values.size != want:
        what = "head_dim" if heads else "heads x head_dim"
        raise ValueError(f"hooks.steer[{i}].vector: length {values.size}, {s.site} needs "
                         f"{want} ({what})")
    if not np.isfinite(values).all():
        raise ValueError(f"hooks.steer[{i}].vector: overflows float32")
    if not heads:
        return values.astype(np.float32).tobytes()
    row[list(heads)] = values
    return row.tobytes()


def _steer_heads(s: Steer, i: int, shape: ModelShape) -> tuple[int, ...]:
    bad = [h for h in s.heads or () if not 0 <= h < shape.num_heads]
    if bad:
        raise ValueError(f"hooks.steer[{i}].heads: head {bad[0]} is out of range: "
                         f"{s.site} has {shape.num_heads} heads (0..{shape.num_heads - 1})")
    return tuple(sorted(set(s.heads or ())))


def _vector(s: Steer, i: int, shape: ModelShape, vectors: VectorRegistry | None) -> bytes:
    """A steer's vector as float32 bytes: its values, or the registered vector it names."""
    data = hidden_vector(s.vector, f"hooks.steer[{i}].vector", shape, vectors)
    if isinstance(s.vector, str) and s.op != "add" and not np.frombuffer(data, np.float32).any():
        raise ValueError(f"hooks.steer[{i}]: op {s.op!r} needs a non-zero vector "
                         f"(it projects on it); {short(s.vector)} is zero")
    return data


def _site_vector(s: Steer, site: Site, i: int, shape: ModelShape,
                 vectors: VectorRegistry | None) -> bytes:
    """The entry's vector for its site: the residual stream, or the heads of z."""
    if site.kind == "attn_z":
        if s.op not in ("add", "scale"):
            raise ValueError(f"hooks.steer[{i}].op: at {site.name} only 'add' and 'scale' act "
                             f"(per head); {s.op!r} acts on the residual stream")
        return _head_vector(s, i, shape, vectors)
    if not site.is_residual:
        raise ValueError(f"hooks.steer[{i}].site: steering acts on the residual stream "
                         f"(hook_resid_pre|mid|post) and on heads at attn.hook_z; "
                         f"{site.name} can be captured only")
    if s.op == "scale" or s.heads is not None:
        raise ValueError(f"hooks.steer[{i}].{'op' if s.op == 'scale' else 'heads'}: "
                         f"{site.name} has no heads (per-head edits act at attn.hook_z)")
    return _vector(s, i, shape, vectors)


def _steers(spec: HookSpec, shape: ModelShape,
            vectors: VectorRegistry | None) -> tuple[SteerEntry, ...]:
    if len(spec.steer) > shape.max_steers:
        raise ValueError(f"hooks.steer: {len(spec.steer)} steers, more than the engine's "
                         f"{shape.max_steers} per request (hook_config.max_steers)")
    steers, reach = [], 0.0
    dtype_max = DTYPE_MAX.get(shape.dtype, DTYPE_MAX["float32"])
    for i, s in enumerate(spec.steer):
        for name in ("scale", "target", "min", "max"):
            check_float32(getattr(s, name), f"hooks.steer[{i}].{name}")
        site = site_of(s.site, f"hooks.steer[{i}]", shape)
        raw = _site_vector(s, site, i, shape, vectors)
        reach += _magnitude(s, raw, i, shape)
        if reach > dtype_max * HEADROOM:
            raise ValueError(f"hooks.steer[{i}]: this request's steering reaches {reach:g} at "
                             f"a position, past 1/16 of the largest {shape.dtype} "
                             f"({dtype_max:g}): the stream would overflow")
        a, lo, hi = steer_bounds(s)
        positions = rule_of(s.positions, f"hooks.steer[{i}]", shape.max_model_len)
        condition = None if s.condition is None else condition_entry(
            s.condition, site, positions, f"hooks.steer[{i}].condition", shape, vectors)
        steers.append(SteerEntry(site.layer, site.kind, raw, vector_key(raw), a, lo, hi,
                                 positions, steer_gain(s), condition))
    keys = {s.key for s in steers} | {s.condition.key for s in steers if s.condition}
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
        site = site_of(c.site, f"hooks.capture[{i}]", shape)
        if site in seen:
            raise ValueError(f"hooks.capture[{i}].site: {site.name} is captured twice; "
                             f"merge the positions into one entry")
        seen.add(site)
        heads = _heads(c.heads, site, i, shape)
        positions = rule_of(c.positions, f"hooks.capture[{i}]", shape.max_model_len)
        if c.sink and not shape.sink:
            raise ValueError(f"hooks.capture[{i}].sink: this engine has no bulk sink "
                             f"(hook_config.sink_dir)")
        if c.sink and site.capture_family == "pattern":
            raise ValueError(f"hooks.capture[{i}].sink: {site.name}: attention patterns "
                             f"do not go to the sink (row sites only)")
        if site.capture_family == "pattern":
            patterns.append(PatternEntry(site.layer, site.name, c.dtype,
                                         heads or tuple(range(shape.num_heads)), positions))
        else:
            rows.append(CaptureEntry(site.layer, site.kind, site.name, c.dtype, heads,
                                     positions, c.sink))
    return tuple(rows), tuple(patterns)


def normalise(spec: HookSpec, shape: ModelShape,
              vectors: VectorRegistry | None = None) -> NormalisedSpec:
    """Check against the model and engine (and the frontend's registered vectors);
    return the worker's data-only form."""
    steers = _steers(spec, shape, vectors)
    captures, patterns = _captures(spec, shape)
    probes = scores.probes(spec, shape, vectors)
    masses = scores.masses(spec, shape)
    out = NormalisedSpec(steer=steers, capture=captures, pattern=patterns, probe=probes,
                         mass=masses, guard=scores.guard(spec, masses, probes, shape),
                         save_to=_save_to(spec.save_to, shape.save_root,
                                          bool(captures or patterns or probes or masses)),
                         encoding=spec.encoding)
    keys = out.vector_keys
    if len(keys) > shape.max_vectors:
        raise ValueError(f"hooks: {len(keys)} distinct vectors (steering and probe weights), "
                         f"more than the engine's resident table of {shape.max_vectors} "
                         f"(hook_config.max_vectors)")
    return out


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
