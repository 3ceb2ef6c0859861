"""Vectors as float32 bytes: `{"b64": "<base64 of little-endian float32>"}` wherever a
spec takes a vector (steer vectors, probe weights, condition vectors). A 4096-float JSON
list costs the server ~0.3 ms to validate element by element and ~3x the bytes; packed,
it is decoded and checked in a few vectorised calls. Offline callers' numpy arrays and
torch tensors become packed vectors directly (no list in between)."""
from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, PrivateAttr, model_validator

LITTLE_F32 = np.dtype("<f4")


class Packed(BaseModel):
    """A vector's float32 values, base64-encoded little-endian bytes."""

    model_config = ConfigDict(extra="forbid", strict=True)
    b64: str
    _values: np.ndarray = PrivateAttr()

    @model_validator(mode="after")
    def _decode(self):
        if (self.__pydantic_private__ or {}).get("_values") is not None:
            return self  # an instance passing a field's union again: decoded already
        try:
            raw = base64.b64decode(self.b64, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("b64: not base64 (RFC 4648, with padding)") from None
        if not raw or len(raw) % 4:
            raise ValueError(f"b64: {len(raw)} bytes is not a whole number (> 0) of float32 "
                             f"values")
        self._values = _finite(np.frombuffer(raw, LITTLE_F32).astype(np.float32), "b64: ")
        return self

    @property
    def values(self) -> np.ndarray:
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    @classmethod
    def of(cls, values) -> "Packed":
        """An offline caller's array, kept as float32 values (no base64 round trip; b64
        stays empty: a spec is never sent on from its parsed form)."""
        if hasattr(values, "detach"):  # torch
            values = values.detach().float().cpu().numpy()
        values = np.array(values, dtype=np.float32)  # a copy the caller cannot change
        if not values.size:
            raise ValueError("a vector needs at least one value")
        packed = cls.model_construct(b64="")
        packed._values = _finite(values)
        return packed


def _finite(values: np.ndarray, where: str = "") -> np.ndarray:
    finite = np.isfinite(values)
    if not finite.all():
        bad = int(np.argmin(finite))
        raise ValueError(f"{where}element {bad} is {values[bad]}: vectors must be finite")
    return values


def is_array(value: Any) -> bool:
    """A 1-D numpy array or torch tensor of numbers (what packs)."""
    return hasattr(value, "tolist") and getattr(value, "ndim", 0) == 1 and \
        not isinstance(value, (str, bytes))


def values_of(vector) -> np.ndarray:
    """A spec vector's values as float32 (a list or a packed vector; names are resolved
    by the caller). Values beyond float32 become inf here: callers check finiteness."""
    if isinstance(vector, Packed):
        return vector.values
    with np.errstate(over="ignore"):
        return np.asarray(vector, dtype=np.float32)
