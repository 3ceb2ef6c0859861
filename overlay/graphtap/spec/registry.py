"""Named steering vectors, registered with the server (`/v1/graphtap/vectors`) or loaded
from `hook_config.vectors_dir` at start; a spec names one with `"vector": "name"`.

Names are resolved into float32 bytes when a request is admitted (spec/normalise.py),
so a live request keeps its vector whatever happens to the name later, and the worker
never sees names. One registry per engine frontend."""
from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class NamedVector:
    """A registered vector: float32 values, and what GET lists of it."""

    name: str
    data: bytes  # float32, native byte order (what SteerEntry.vector carries)
    dim: int
    norm: float
    sha256: str

    def describe(self) -> dict:
        return {"name": self.name, "dim": self.dim, "norm": self.norm, "sha256": self.sha256}


@dataclass(frozen=True)
class NamedProbe:
    """A registered linear probe (a vectors_dir file holding a 2-D "weight" [P, hidden],
    optionally "bias" [P] and an "activation" in its metadata): `"weights": name` in a
    probe entry takes its rows, bias and activation."""

    name: str
    rows: tuple[NamedVector, ...]
    bias: tuple[float, ...]
    activation: str  # "none" | "sigmoid"

    def describe(self) -> dict:
        return {"name": self.name, "probe": len(self.rows), "dim": self.rows[0].dim,
                "activation": self.activation}


class VectorRegistry:
    """name -> NamedVector (and NamedProbe), for one engine (hidden size `dim`), at most
    `capacity` vectors (a probe's rows count)."""

    def __init__(self, dim: int, capacity: int):
        self.dim, self.capacity = dim, capacity
        self._vectors: dict[str, NamedVector] = {}
        self._probes: dict[str, NamedProbe] = {}
        self._lock = threading.Lock()
        # bumped by every change: what a spec that names vectors normalises to changes
        self.generation = 0

    def check(self, name: str, values) -> NamedVector:
        """The vector `values` would register as `name`; ValueError naming what is wrong."""
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"name: {name!r} is not a vector name (letters, digits, '.', "
                             f"'_', '-'; 1 to 128 characters, starting with a letter or digit)")
        try:
            data = np.asarray(values, dtype=np.float32)
        except (TypeError, ValueError):
            raise ValueError("vector: expected numbers") from None
        if data.ndim != 1 or data.shape[0] != self.dim:
            raise ValueError(f"vector: shape {tuple(data.shape)}, the model's hidden size is "
                             f"{self.dim}")
        if not np.isfinite(data).all():
            raise ValueError("vector: values must be finite in float32")
        raw = data.tobytes()
        return NamedVector(name, raw, self.dim, float(np.linalg.norm(data.astype(np.float64))),
                           hashlib.sha256(raw).hexdigest())

    def register(self, vectors: list[NamedVector]) -> None:
        """Add or replace, all or none (the capacity counts the names after the call)."""
        with self._lock:
            names = set(self._vectors) | {v.name for v in vectors}
            if len(names) > self.capacity:
                raise ValueError(f"name: the registry holds at most {self.capacity} vectors "
                                 f"(hook_config.max_registered_vectors)")
            for v in vectors:
                self._vectors[v.name] = v
            self.generation += 1

    def delete(self, name: str) -> bool:
        with self._lock:
            self.generation += 1
            return self._vectors.pop(name, None) is not None

    def get(self, name: str) -> NamedVector | None:
        return self._vectors.get(name)

    def probe(self, name: str) -> NamedProbe | None:
        return self._probes.get(name)

    def list(self) -> list[dict]:
        with self._lock:
            return [v.describe() for v in sorted([*self._vectors.values(), *self._probes.values()],
                                                 key=lambda v: v.name)]

    def check_probe(self, name: str, weight, bias=None, activation: str = "none") -> NamedProbe:
        """A probe from a [P, hidden] weight (and [P] bias): ValueError naming what is wrong."""
        weight = np.asarray(weight, dtype=np.float32)
        if weight.ndim != 2 or not weight.shape[0]:
            raise ValueError(f"weight: shape {tuple(weight.shape)}, a probe is [P, {self.dim}]")
        rows = tuple(self.check(name, w) for w in weight)
        bias = np.zeros(len(rows), np.float32) if bias is None else \
            np.asarray(bias, dtype=np.float32).reshape(-1)
        if bias.shape != (len(rows),) or not np.isfinite(bias).all():
            raise ValueError(f"bias: {len(rows)} finite values expected (one per weight row)")
        if activation not in ("none", "sigmoid"):
            raise ValueError(f"activation: {activation!r} is not 'none' or 'sigmoid'")
        return NamedProbe(name, rows, tuple(float(b) for b in bias), activation)

    def from_safetensors(self, blob: bytes, name: str | None = None) -> list[NamedVector]:
        """The vectors of a safetensors file: each tensor by its key, or a file of one
        tensor by `name` when given."""
        from safetensors.numpy import load

        try:
            tensors = load(blob)
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"body: not a safetensors file ({type(e).__name__})") from None
        if name is not None and len(tensors) != 1:
            raise ValueError(f"name: the file holds {len(tensors)} tensors; a name applies "
                             f"to a file of one")
        return [self.check(name or key, t.reshape(-1) if t.ndim == 2 and t.shape[0] == 1
                           else t) for key, t in sorted(tensors.items())]

    def load_dir(self, directory: str) -> int:
        """Every *.safetensors file of a folder: a file of one tensor registers as its
        stem, one of several as stem.key; a probe file (a 2-D "weight", graphtap.vectors
        .save_probe) as the probe named by its stem."""
        vectors, probes = [], []
        for path in sorted(Path(directory).glob("*.safetensors")):
            probe = self._probe_file(path)
            if probe is not None:
                probes.append(probe)
                continue
            found = self.from_safetensors(path.read_bytes())
            if len(found) == 1:
                vectors.append(self.check(path.stem, np.frombuffer(found[0].data, np.float32)))
            else:
                vectors += [self.check(f"{path.stem}.{v.name}", np.frombuffer(v.data, np.float32))
                            for v in found]
        self.register(vectors)
        with self._lock:
            for p in probes:
                self._probes[p.name] = p
            self.generation += 1
        return len(vectors) + len(probes)

    def _probe_file(self, path: Path) -> NamedProbe | None:
        from safetensors import safe_open

        with safe_open(str(path), "np") as f:
            keys = set(f.keys())
            if "weight" not in keys or f.get_slice("weight").get_shape().__len__() != 2:
                return None
            meta = f.metadata() or {}
            try:
                return self.check_probe(path.stem, f.get_tensor("weight"),
                                        f.get_tensor("bias") if "bias" in keys else None,
                                        meta.get("activation", "none"))
            except ValueError as e:
                raise ValueError(f"{path.name}: {e}") from None
