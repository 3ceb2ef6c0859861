"""Resident steering vectors in the worker: content-keyed, refcounted by live requests,
least-recently-used rows reused first, new rows staged and written with the step's other
table rows. The frontend admits only requests whose vectors fit, so `acquire` failing
means the two sides disagree: that request fails loudly (its error), nothing else."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from graphtap.engine.slots import host_to_device
from graphtap.ops.tables import SteerTables


class BankFull(RuntimeError):
    """No row for a new vector: the request is refused, never the engine stopped."""


class VectorBank:
    """The engine's resident steering vectors (rows of SteerTables.bank)."""

    def __init__(self, tables: SteerTables):
        self.t = tables
        self.capacity = tables.bank.shape[0] - 1  # row 0 stays zero
        self._rows: OrderedDict[str, int] = OrderedDict()  # key -> row, LRU first
        self._refs: dict[str, int] = {}
        self._free = list(range(self.capacity, 0, -1))
        self._pending: dict[int, tuple[torch.Tensor, float]] = {}  # row -> (vector, 1/|v|)

    def acquire(self, key: str, data: bytes) -> int:
        row = self._rows.get(key)
        if row is None:
            row = self._take_row(key)
            # A residual vector or a z row (heads x head_dim), zero-padded to the bank's
            # width: the op reads as many columns as its row has.
            values = np.zeros(self.t.bank.shape[1], np.float32)
            given = np.frombuffer(data, dtype=np.float32)
            values[:given.size] = given
            stored = torch.from_numpy(values).to(self.t.bank.dtype)
            # The norm of the vector as stored (bf16 rounds it), so v_hat is a unit vector.
            norm = float(stored.float().norm())
            self._pending[row] = (stored, 1.0 / norm if norm > 0 else 0.0)
            self._rows[key] = row
        self._rows.move_to_end(key)
        self._refs[key] = self._refs.get(key, 0) + 1
        return row

    def acquire_all(self, vectors: list[tuple[str, bytes]]) -> list[int]:
        """Rows for (key, data) pairs, all or none: on BankFull the ones taken are
        released before it propagates."""
        rows: list[int] = []
        try:
            for key, data in vectors:
                rows.append(self.acquire(key, data))
        except BankFull:
            for key, _ in vectors[:len(rows)]:
                self.release(key)
            raise
        return rows

    def release(self, key: str) -> None:
        n = self._refs.get(key, 0) - 1
        if n <= 0:
            self._refs.pop(key, None)  # the row stays resident until reused (LRU)
        else:
            self._refs[key] = n

    def apply(self) -> None:
        """Write the staged rows: one copy of the vectors and one of their norms."""
        if not self._pending:
            return
        rows = sorted(self._pending)
        device = self.t.bank.device
        index = host_to_device(np.asarray(rows, dtype=np.int64), device)
        vectors = torch.stack([self._pending[r][0] for r in rows])
        inv = torch.tensor([self._pending[r][1] for r in rows], dtype=torch.float32)
        self._pending.clear()
        self.t.bank.index_copy_(0, index, host_to_device(vectors, device))
        self.t.inv_norm.index_copy_(0, index, host_to_device(inv, device))

    def _take_row(self, key: str) -> int:
        if self._free:
            return self._free.pop()
        for old, row in self._rows.items():  # least recently used first
            if old not in self._refs:
                del self._rows[old]
                return row
        raise BankFull(
            f"refused by the engine: all {self.capacity} resident vector rows are held by "
            f"live requests (hook_config.max_vectors; the frontend admits only what fits, "
            f"so please report it)")

    def resident(self) -> int:
        return len(self._rows)

    def held(self) -> int:
        """Vectors live requests hold (0 once every request has finished)."""
        return len(self._refs)
