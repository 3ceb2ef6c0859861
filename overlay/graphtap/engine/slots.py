"""Per-request table rows of every family in one int32 device block: one row per request
slot (and the sentinel slot that never acts), each family's fields a column range.

Families write a new request's row into a host mirror at add_request; the runner's
staged-write slot (apply_staged_writes, once per step with new requests) writes the
changed rows in one go: one index copy, whatever the number of requests or fields (11
copies per request before), reading the rows and their indices from pinned host buffers
the device maps (UVA), as vLLM's own staged writes beside it do: no pinned allocation and
no host-to-device copy call per step (each ~20 us of the engine core's host on the H200).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

_NP = {torch.int32: np.int32, torch.float32: np.float32}


def host_to_device(arr: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array on its way into a device table, without stalling the stream: pinned
    (caching host allocator, so safe with non_blocking) where the device is a GPU."""
    src = torch.from_numpy(arr) if isinstance(arr, np.ndarray) else arr
    if device.type == "cuda":
        src = src.pin_memory()
    return src.to(device, non_blocking=True)


def _field_view(host: np.ndarray, f: "SlotField") -> np.ndarray:
    """A field of an int32 host block [slots, width] as [slots, *shape] of its dtype."""
    block = host if f.dtype == torch.int32 else host.view(_NP[f.dtype])
    return block[:, f.offset:f.offset + f.size].reshape(block.shape[0], *f.shape)


@dataclass(frozen=True)
class SlotField:
    """A column range of the block: per slot, `shape` values of a 32-bit dtype."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float | tuple[float, ...]  # inactive value (a tuple: along the last dim)

    @property
    def size(self) -> int:
        return math.prod(self.shape)  # not np.prod: ~5 us a call, ~30 calls an admission


class SlotLayout:
    """The block's fields, reserved before it is allocated."""

    def __init__(self) -> None:
        self.width = 0
        self.fields: list[SlotField] = []

    def reserve(self, shape: tuple[int, ...], dtype: torch.dtype,
                fill: float | tuple[float, ...]) -> SlotField:
        assert dtype in _NP, dtype  # 32-bit values: every field shares the row stride
        field = SlotField(self.width, tuple(shape), dtype, fill)
        self.fields.append(field)
        self.width += field.size
        return field


@dataclass(frozen=True)
class FieldGroup:
    """Fields reset together (SlotBlock.group): their columns as (slice, inactive values)
    runs, and per slot 1 where they are known inactive on the host and on the device
    once the staged writes ran (reset with claim False)."""

    runs: list[tuple[slice, np.ndarray]]
    clean: bytearray


class Staging:
    """Round-robin host buffers a step's changed rows reach the device from: `depth`
    of them, so the rows staged for a step stay as they were until the device has read
    them (the engine runs at most max_concurrent_batches steps ahead of the device, as
    vLLM's UvaBufferPool assumes for the staged writes beside these). On a GPU they are
    pinned and read by the index copy through their device view (UVA, vLLM's); elsewhere
    the copy reads them directly."""

    def __init__(self, rows: int, width: int, device: torch.device, depth: int):
        assert depth >= 2, depth
        self._pinned = device.type == "cuda"
        self._host = [(torch.zeros(rows, dtype=torch.int64, pin_memory=self._pinned),
                       torch.zeros((rows, width), dtype=torch.int32, pin_memory=self._pinned))
                      for _ in range(depth)]
        self._bufs: list[tuple] | None = None  # made at the first stage (below)
        self._next = 0

    def stage(self, rows: np.ndarray, host: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' indices and their host values, in the next buffer: its device views."""
        if self._bufs is None:
            # the device views at first use: tools that allocate tables and never stage
            # a row (benchmarks/gpu/check_kernels.py) need no vLLM
            self._bufs = [(i.numpy(), v.numpy(), _device_view(i, self._pinned),
                           _device_view(v, self._pinned)) for i, v in self._host]
        index, values, index_dev, values_dev = self._bufs[self._next]
        self._next = (self._next + 1) % len(self._bufs)
        k = len(rows)
        index[:k] = rows
        np.take(host, rows, axis=0, out=values[:k])
        return index_dev[:k], values_dev[:k]


def _device_view(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    if not pinned:
        return t
    from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

    return get_accelerator_view_from_cpu_tensor(t)


class SlotBlock:
    """The block itself: its device tensor, the host mirror, the rows to write."""

    def __init__(self, layout: SlotLayout, slots: int, device: torch.device,
                 staging_depth: int = 2):
        self.device = device
        width = max(layout.width, 1)
        self.host = np.zeros((slots, width), dtype=np.int32)
        for f in layout.fields:
            self.host_view(f)[:] = f.fill
        self.gpu = torch.from_numpy(self.host.copy()).to(device)
        self.staging = Staging(slots, width, device, staging_depth)
        self._dirty: set[int] = set()
        self._groups: dict[tuple[int, ...], FieldGroup] = {}  # by the fields' offsets

    def view(self, f: SlotField) -> torch.Tensor:
        """The device view of a field: [slots, *shape], strides (block width, ...)."""
        block = self.gpu if f.dtype == torch.int32 else self.gpu.view(f.dtype)
        return block[:, f.offset:f.offset + f.size].view(block.shape[0], *f.shape)

    def host_view(self, f: SlotField) -> np.ndarray:
        return _field_view(self.host, f)

    def group(self, fields: list[SlotField]) -> FieldGroup:
        """The fields a family resets together, made once (the same object for the same
        fields: one account of which slots hold them inactive)."""
        key = tuple(f.offset for f in fields)
        if key not in self._groups:
            row = np.zeros((1, self.host.shape[1]), dtype=np.int32)
            for f in fields:
                _field_view(row, f)[0] = f.fill
            cols = sorted({c for f in fields for c in range(f.offset, f.offset + f.size)})
            # the columns as runs (fields reserved one after another are one slice)
            runs, first = [], 0
            for i in range(1, len(cols) + 1):
                if i == len(cols) or cols[i] != cols[i - 1] + 1:
                    lo, hi = cols[first], cols[i - 1] + 1
                    runs.append((slice(lo, hi), row[0, lo:hi].copy()))
                    first = i
            # every slot starts inactive
            self._groups[key] = FieldGroup(runs, bytearray(b"\x01" * self.host.shape[0]))
        return self._groups[key]

    def reset(self, slot: int, group: FieldGroup, claim: bool | None = None) -> None:
        """A slot's fields (a group) back to inactive (a family rewrites its whole row per
        request, so a reused slot inherits nothing). `claim`: True, the family writes
        the slot's entries next (staged either way); False, the request holds none of
        them: nothing to do where the fields are inactive already, on the host and on
        the device once the staged writes ran (most families of most requests: a plain
        request went through every family's reset, ~70 us of its admission on the H200
        host); None, rewritten and staged whatever they hold. The ops write nothing of
        an inactive slot."""
        clean = group.clean
        if claim is False and clean[slot]:
            return
        if not (claim and clean[slot]):
            host = self.host[slot]
            for cols, values in group.runs:
                host[cols] = values
        self._dirty.add(slot)
        clean[slot] = claim is False

    def stage(self, slot: int) -> None:
        self._dirty.add(slot)

    def apply(self) -> None:
        if not self._dirty:
            return
        rows = np.fromiter(sorted(self._dirty), dtype=np.int64, count=len(self._dirty))
        self._dirty.clear()
        self.gpu.index_copy_(0, *self.staging.stage(rows, self.host))
