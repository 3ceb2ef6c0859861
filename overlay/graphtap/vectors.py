"""Resident steering vectors in the worker: content-keyed, refcounted by live requests,
least-recently-used rows reused first. The frontend admits only requests whose vectors
fit (see frontend.py), so `acquire` failing means the two sides disagree: loud error."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from graphtap.tables import SteerTables


class VectorBank:
    def __init__(self, tables: SteerTables):
        self.t = tables
        self.capacity = tables.bank.shape[0] - 1  # row 0 stays zero
        self._rows: OrderedDict[str, int] = OrderedDict()  # key -> row, LRU first
        self._refs: dict[str, int] = {}
        self._free = list(range(self.capacity, 0, -1))

    def acquire(self, key: str, data: bytes) -> int:
        row = self._rows.get(key)
        if row is None:
            row = self._take_row(key)
            vec = torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy())
            stored = vec.to(self.t.bank.dtype)
            # The norm of the vector as stored (bf16 rounds it), so v_hat is a unit vector.
            norm = float(stored.float().norm())
            self.t.bank[row].copy_(stored)
            self.t.inv_norm[row] = 1.0 / norm if norm > 0 else 0.0
            self._rows[key] = row
        self._rows.move_to_end(key)
        self._refs[key] = self._refs.get(key, 0) + 1
        return row

    def release(self, key: str) -> None:
        n = self._refs.get(key, 0) - 1
        if n <= 0:
            self._refs.pop(key, None)  # the row stays resident until reused (LRU)
        else:
            self._refs[key] = n

    def _take_row(self, key: str) -> int:
        if self._free:
            return self._free.pop()
        for old, row in self._rows.items():  # least recently used first
            if old not in self._refs:
                del self._rows[old]
                return row
        raise RuntimeError(
            f"graphtap: all {self.capacity} resident vector rows are held by live requests "
            f"and vector {key} needs one; the frontend should have refused this request "
            f"(several API servers sharing one engine are not supported)")

    def resident(self) -> int:
        return len(self._rows)
