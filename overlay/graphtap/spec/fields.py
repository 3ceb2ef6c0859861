"""The pieces every spec model shares: strict parsing, how a user's string is quoted,
position rules, and how offline callers' numpy / torch values come in."""
from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      ValidationError, model_validator)

from graphtap.spec.packed import Packed, is_array

# Strict: a JSON true or "2.5" is not a number, 1.0 is not a head; integers are floats.
STRICT = ConfigDict(extra="forbid", strict=True)


def short(text, limit: int = 60) -> str:
    """A user's string as an error message quotes it: a 1 MB name is not echoed back."""
    text = str(text)
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"


NAMED_POSITIONS = ("all", "prompt", "generated", "last_prompt")


class PositionRange(BaseModel):
    """Positions start <= p < end (end exclusive, like a Python slice)."""

    model_config = STRICT
    start: int = Field(ge=0)
    end: int = Field(gt=0)

    @model_validator(mode="after")
    def _ordered(self):
        if self.end <= self.start:
            raise ValueError(f"end ({self.end}) must be greater than start ({self.start})")
        return self


def parse_positions(p: Any):
    """Dispatch on the JSON type, so an error speaks about the form the user chose."""
    if isinstance(p, str):
        if p not in NAMED_POSITIONS:
            raise ValueError(f"{short(p)} is not one of {', '.join(NAMED_POSITIONS)}")
        return p
    if isinstance(p, dict) or isinstance(p, PositionRange):
        return PositionRange.model_validate(p)
    if hasattr(p, "tolist") and not isinstance(p, (str, dict)):  # numpy / torch
        p = p.tolist()
    if isinstance(p, list):
        if not p:
            raise ValueError("an empty list selects nothing")
        bad = next((x for x in p if isinstance(x, bool) or not isinstance(x, int) or x < 0), None)
        if bad is not None:
            raise ValueError(f"positions must be integers >= 0, got {bad!r}")
        return list(p)
    raise ValueError("expected a name, a list of positions or {\"start\": s, \"end\": e}")


def plain(value: Any) -> Any:
    """numpy / torch values (offline callers) as the JSON values they stand for."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    if isinstance(value, list) and value and hasattr(value[0], "item") and \
            not isinstance(value[0], (bool, int, float)):
        return [v.item() if hasattr(v, "item") else v for v in value]
    return value


def vector_in(value: Any) -> Any:
    """A vector field's input: numpy arrays and torch tensors pack (no float list); a
    JSON object is a packed vector, its errors reported as its own (not as the first
    member of the field's union, "should be a valid list")."""
    if is_array(value):
        return Packed.of(value)
    if isinstance(value, dict):
        try:
            return Packed.model_validate(value)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            raise ValueError(f"{where}: {msg}" if where else msg) from None
    return plain(value)


def check_vector(v):
    """A vector field's value once parsed: packed (checked as it was decoded), a name,
    or a non-empty list of finite floats."""
    if v is None or isinstance(v, Packed):
        return v
    if isinstance(v, str):
        if not v:
            raise ValueError("a vector name must not be empty")
        return v
    if not v:
        raise ValueError("a vector needs at least one value")
    bad = next((i for i, x in enumerate(v) if not math.isfinite(x)), None)
    if bad is not None:
        raise ValueError(f"element {bad} is {v[bad]}: vectors must be finite")
    return v


# A vector field: values (a list, or packed float32 bytes) or a registered name; numpy /
# torch inputs pack, a JSON object is checked as a packing.
Vector = Annotated[list[float] | Packed | str, BeforeValidator(vector_in),
                   AfterValidator(check_vector)]
