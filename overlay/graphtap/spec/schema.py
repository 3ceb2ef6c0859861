"""What a user writes: the request spec's schema (pydantic), parsed with errors that name
the field.

In `SamplingParams.hooks`, or as a JSON string in `extra_args["hooks"]` / `vllm_xargs`
over HTTP:

    {"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "vector": [...],
                "scale": 4.0, "positions": "all"}],
     "capture": [{"site": "blocks.12.hook_resid_post", "positions": "last_prompt"}]}
"""
from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from graphtap.spec.fields import (NAMED_POSITIONS, STRICT, PositionRange, Vector,  # noqa: F401
                                   parse_positions, plain, short, vector_in)
from graphtap.spec.packed import Packed, values_of

OPS = ("add", "set_projection", "ablate", "clamp", "scale")
MAX_HEAD_SCALE = 256.0  # past this a head's output is not scaled but overflowed


class Condition(BaseModel):
    """A steer's gate (conditional steering, after IBM's CAST): a score of the residual
    stream at `site` at the last prompt token, computed on the device; the steer acts
    only when the score is past `threshold` ("above", or "below" with `compare`).
    "projection" scores <h, v/|v|>; "probe" scores act(<h, w> + bias). Decided once per
    request, before any generated token, so a gated steer acts at "generated" positions
    (or at the last prompt token, at a later site)."""

    model_config = STRICT

    site: str
    vector: Vector
    """The condition direction or probe weights: hidden-size values (a list, or packed
    float32 bytes {"b64": ...}), or a registered name."""
    threshold: float
    score: Literal["projection", "probe"] = "projection"
    compare: Literal["above", "below"] = "above"
    bias: float = 0.0
    activation: Literal["none", "sigmoid"] = "none"

    @field_validator("threshold", "bias", mode="before")
    @classmethod
    def _numpy(cls, v: Any):
        return plain(v)

    @field_validator("threshold", "bias")
    @classmethod
    def _finite_number(cls, x: float) -> float:
        if not math.isfinite(x):
            raise ValueError(f"must be finite, got {x}")
        return x

    @model_validator(mode="after")
    def _probe_fields(self):
        if self.score == "projection" and (self.bias != 0.0 or self.activation != "none"):
            raise ValueError("bias and activation belong to score 'probe' (a projection is "
                             "<h, v/|v|>)")
        return self


class Steer(BaseModel):
    """One edit at one site: of the residual stream, or of chosen heads' outputs at
    attn.hook_z (the interpretability staple: "scale" with scale 0 ablates a head)."""

    model_config = STRICT

    site: str
    op: Literal["add", "set_projection", "ablate", "clamp", "scale"]
    vector: Vector | None = None
    """The direction: its values (a list, or packed float32 bytes {"b64": ...}), or the
    name of a vector registered with the server.
    At attn.hook_z with `heads`: head_dim values, added to each chosen head."""
    heads: list[int] | None = Field(None, min_length=1)
    """attn.hook_z only: the query heads edited ("scale" needs them)."""
    scale: float = 1.0
    target: float | None = None
    min: float | None = None
    max: float | None = None
    positions: Any = "all"
    condition: Condition | None = None
    """Steer only when the prompt meets it (the gate is data on the device)."""

    @field_validator("positions", mode="before")
    @classmethod
    def _positions(cls, p: Any):
        return parse_positions(p)

    @field_validator("scale", "target", "min", "max", "heads", mode="before")
    @classmethod
    def _numpy(cls, v: Any):
        return plain(v)

    @field_validator("scale", "target", "min", "max")
    @classmethod
    def _finite_number(cls, x: float | None) -> float | None:
        if x is not None and not math.isfinite(x):
            raise ValueError(f"must be finite, got {x}")
        return x

    @model_validator(mode="after")
    def _op_fields(self):
        if self.op == "scale":
            if self.vector is not None:
                raise ValueError("op 'scale' multiplies the chosen heads by 'scale'; it takes "
                                 "no vector")
            if self.heads is None:
                raise ValueError("op 'scale' needs 'heads' (the query heads it scales)")
            if abs(self.scale) > MAX_HEAD_SCALE:
                raise ValueError(f"op 'scale': scale {self.scale} is beyond "
                                 f"+-{MAX_HEAD_SCALE:g}")
            return self
        if self.vector is None:
            raise ValueError(f"op {self.op!r} needs 'vector'")
        if self.op == "set_projection" and self.target is None:
            raise ValueError("op 'set_projection' needs 'target'")
        if self.op == "clamp":
            if self.min is None or self.max is None:
                raise ValueError("op 'clamp' needs 'min' and 'max'")
            if self.min > self.max:
                raise ValueError(f"clamp min ({self.min}) is greater than max ({self.max})")
        if self.op in ("set_projection", "ablate", "clamp") and \
                not isinstance(self.vector, str) and not values_of(self.vector).any():
            raise ValueError(f"op {self.op!r} needs a non-zero vector (it projects on it)")
        return self


class _Rows(BaseModel):
    """What captures and attention mass share: query positions and heads, parsed alike."""

    model_config = STRICT

    @field_validator("positions", mode="before", check_fields=False)
    @classmethod
    def _positions(cls, p: Any):
        return parse_positions(p)

    @field_validator("heads", mode="before", check_fields=False)
    @classmethod
    def _numpy(cls, v: Any):
        return plain(v)


class Capture(_Rows):
    """Rows of one site returned with the request."""

    model_config = STRICT

    site: str
    positions: Any = "all"
    dtype: Literal["model", "float32"] = "model"
    heads: list[int] | None = Field(None, min_length=1)
    """Attention sites only: which heads (q, z and pattern: query heads; k and v: KV
    heads). Default: all."""
    sink: bool = False
    """The rows go to the engine's bulk sink (hook_config.sink_dir) instead of coming
    back with the request: harvesting at volume. Row sites only (not hook_pattern)."""


class Probe(BaseModel):
    """Linear probes on one residual site, applied on the device: per wanted position one
    score per weight vector, act(<h, w_i> + b_i), returned as `probe:<site>` rows
    [positions, len(weights)] (float32) instead of the hidden states themselves."""

    model_config = STRICT

    site: str
    weights: list[list[float] | Packed | str] | str = Field(min_length=1)
    """One vector per score (hidden-size values, or the name of a registered vector), or
    the name of a registered probe (its rows, bias and activation)."""
    bias: list[float] | None = None
    """One per weight vector; default 0 (a registered probe's: its own)."""
    activation: Literal["none", "sigmoid"] | None = None
    """Default "none" (a registered probe's: its own)."""
    positions: Any = "all"

    @field_validator("positions", mode="before")
    @classmethod
    def _positions(cls, p: Any):
        return parse_positions(p)

    @field_validator("weights", mode="before")
    @classmethod
    def _rows(cls, v: Any):
        if hasattr(v, "tolist") and getattr(v, "ndim", 0) == 2:  # [P, hidden] array
            return [Packed.of(w) for w in v]
        return [vector_in(w) for w in v] if isinstance(v, (list, tuple)) else v

    @field_validator("bias", mode="before")
    @classmethod
    def _numpy(cls, v: Any):
        return plain(v)

    @field_validator("weights")
    @classmethod
    def _finite(cls, rows: list | str) -> list | str:
        if isinstance(rows, str):
            return rows  # a registered probe: resolved at admission
        for i, w in enumerate(rows):
            if isinstance(w, Packed):
                continue
            if isinstance(w, str):
                if not w:
                    raise ValueError(f"weights[{i}]: a vector name must not be empty")
                continue
            bad = next((j for j, x in enumerate(w) if not math.isfinite(x)), None)
            if bad is not None:
                raise ValueError(f"weights[{i}]: element {bad} is {w[bad]}: weights must "
                                 f"be finite")
        return rows

    @model_validator(mode="after")
    def _bias(self):
        if self.bias is not None:
            if not isinstance(self.weights, str) and len(self.bias) != len(self.weights):
                raise ValueError(f"bias has {len(self.bias)} values for {len(self.weights)} "
                                 f"weight vectors")
            bad = next((b for b in self.bias if not math.isfinite(b)), None)
            if bad is not None:
                raise ValueError(f"bias must be finite, got {bad}")
        return self


class AttentionMass(_Rows):
    """Attention mass on key spans, on the device: for the chosen query heads at the query
    positions of a configured `blocks.{L}.attn.hook_pattern` site, the attention weight
    summed over each span of key positions, returned as `mass:<site>` [queries, heads,
    spans] (float32). Two spans at the last prompt token are the Attention Tracker's
    instruction and data; N spans at a query are in-context re-ranking's documents."""

    model_config = STRICT

    site: str
    spans: list[PositionRange] = Field(min_length=1)
    heads: list[int] | None = Field(None, min_length=1)
    """Query heads (default all)."""
    positions: Any = "last_prompt"


class Guard(BaseModel):
    """A runtime guard on this request's own device scores. "attention_focus": the
    Attention Tracker score at the last prompt token, mean over the request's
    attention_mass entries (or the one at `site`) and their heads of
    mass[span 0] / (mass[span 0] + mass[span 1]); flagged below `threshold`. "probe": the
    score `column` of the request's probe (at `site`, default its first) at generated
    positions; flagged above `threshold`. "stop" finishes a flagged request right after
    that step (finish_reason "guard"); either way the outputs carry `guard`."""

    model_config = STRICT

    kind: Literal["attention_focus", "probe"]
    threshold: float
    action: Literal["annotate", "stop"] = "annotate"
    site: str | None = None
    column: int = Field(0, ge=0)

    @field_validator("threshold")
    @classmethod
    def _finite(cls, x: float) -> float:
        if not math.isfinite(x):
            raise ValueError(f"must be finite, got {x}")
        return x


class HookSpec(BaseModel):
    """A request's whole spec, as the user wrote it."""

    model_config = STRICT
    steer: list[Steer] = Field(default_factory=list)
    capture: list[Capture] = Field(default_factory=list)
    probe: list[Probe] = Field(default_factory=list)
    attention_mass: list[AttentionMass] = Field(default_factory=list)
    guard: Guard | None = None
    save_to: str | None = None
    """Directory for one safetensors file per request (written by the frontend)."""
    encoding: Literal["raw", "safetensors"] = "raw"
    """How an HTTP response carries the captures: per site base64 raw bytes, or one
    base64 safetensors blob (the OpenAI server only; offline outputs are tensors)."""


def _loc(loc: tuple) -> str:
    out = "hooks"
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _pydantic_error(e: ValidationError) -> ValueError:
    err = e.errors()[0]
    msg = err["msg"].removeprefix("Value error, ")
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return ValueError(f"{_loc(err['loc'])}: {msg}{more}")


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
