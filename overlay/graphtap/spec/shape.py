"""What validation knows of the served model and engine, and the checks every family's
normalisation shares (sites, positions, float32 bounds, content keys)."""
from __future__ import annotations

import hashlib
import math

import numpy as np

from pydantic import BaseModel

from graphtap.spec.entries import Span
from graphtap.spec.fields import short
from graphtap.spec.packed import values_of
from graphtap.spec.schema import PositionRange
from graphtap.spec.sites import Site, parse_site


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
    sink: bool = False  # the engine has a bulk sink (hook_config.sink_dir)
    max_response_rows: int = 65536
    dtype: str = "float32"  # the model's: steering arithmetic must stay finite in it
    head_dim: int = 0
    max_response_bytes: int = 256 * 2**20
    max_live_capture_bytes: int = 2 * 2**30
    save_quota_bytes: int = 16 * 2**30
    max_probes: int = 4
    probe_width: int = 8
    max_spans: int = 8


def vector_key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def rule_of(p, field: str, max_len: int):
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


def site_of(name: str, field: str, shape: ModelShape) -> Site:
    try:
        site = parse_site(name, shape.num_layers)
    except ValueError as e:
        raise ValueError(f"{field}.site: {e}") from None
    if site.name not in shape.configured_sites:
        raise ValueError(f"{field}.site: {site.name} has no op in this engine; "
                         f"add it to hook_config.sites")
    return site


# The largest finite value of each model dtype; a request's steering at one position is
# kept below 1/16 of it, so that the stream it edits (and the KV cache made from it)
# stays finite: an inf there turns into NaN downstream (inf * 0, inf - inf) and reaches
# other requests through reused cache blocks.
DTYPE_MAX = {"float32": 3.4028235e38, "bfloat16": 3.3895314e38, "float16": 65504.0}
HEADROOM = 1 / 16


def check_float32(x: float | None, field: str) -> None:
    if x is not None and math.isfinite(x) and abs(x) > DTYPE_MAX["float32"]:
        raise ValueError(f"{field}: {x} overflows float32, the precision of the steering "
                         f"tables")


def hidden_vector(vector, field: str, shape: ModelShape, vectors) -> bytes:
    """A hidden-size vector of a spec (values, packed, or a registered name) as float32
    bytes, or a refusal naming `field`."""
    if isinstance(vector, str):
        named = vectors.get(vector) if vectors is not None else None
        if named is None:
            raise ValueError(f"{field}: no registered vector named {short(vector)} "
                             f"(GET /v1/graphtap/vectors lists them)")
        return named.data
    if len(vector) != shape.hidden_size:
        raise ValueError(f"{field}: length {len(vector)}, the model's hidden size is "
                         f"{shape.hidden_size}")
    data = values_of(vector)
    if not np.isfinite(data).all():
        raise ValueError(f"{field}: overflows float32")
    return data.tobytes()
