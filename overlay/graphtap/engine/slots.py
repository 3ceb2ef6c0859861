"""Per-request table rows of every family in one int32 device block: one row per request
slot (and the sentinel slot that never acts), each family's fields a column range.

Families write a new request's row into a host mirror at add_request; the runner's
staged-write slot (apply_staged_writes, once per step with new requests) writes the
changed rows in one go: one index copy, whatever the number of requests or fields (11
copies per request before), reading the rows and their indices from pinned host buffers
the device maps (UVA), as vLLM's own staged writes beside it do: no pinned allocation and
no host-to-device copy call per step (each ~20 us of the engine core's host on the H200).
Where the router replays its routing graphs, the replay applies them instead (apply(
defer=True), ops/stage_triton.py): one device call fewer before the step's forward.
A long max_model_len's requests (row families' captures, steering) stage only the
columns they set (stage_runs: sites, fields and the position bitmaps' words that hold
set bits), in a second index copy over the flattened block: a row holds every entry's
bitmap of max_model_len / 32 words, hundreds of KiB there (benchmarks/cpu:
test_admission_step_long_context).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

_NP = {torch.int32: np.int32, torch.float32: np.float32}
# single elements a step's staged write holds (SlotBlock.elements, 3 MiB a buffer, where
# rows are staged by runs; a steering entry at every position of max_model_len 131072 is
# 4096 of them); past them rows go whole (an element stages 12 bytes, a row's column 4)
ELEMENTS = 1 << 18
# Slot rows from this size on are staged by the columns a request sets (stage_runs);
# smaller ones whole, which costs less host time than the runs' bookkeeping (dev CPU,
# test_admission_step_long_context: about 1 us a request at max_model_len 2048)
RUNS_FROM_BYTES = 16 << 10
# the words of a deferred write's header (take_pending; ops/stage_triton.py reads them)
HEADER = 4


def _elements(runs: dict[int, list[np.ndarray]], width: int) -> np.ndarray:
    """The flat block indices of the slots' column runs (one numpy pass, not one per
    slot: a burst's admission stages dozens)."""
    arrays = [r for rs in runs.values() for r in rs]
    r = np.concatenate(arrays)
    slot_of = np.repeat(np.fromiter((s for s, rs in runs.items() for _ in rs), np.int64,
                                    len(arrays)) * width, [len(a) for a in arrays])
    lens = r[:, 1] - r[:, 0]
    return np.repeat(r[:, 0] + slot_of - (np.cumsum(lens) - lens), lens) + \
        np.arange(lens.sum())


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
    once the staged writes ran (reset with claim False); `fill`: a block row holding
    the group's inactive values in its columns."""

    runs: list[tuple[slice, np.ndarray]]
    clean: bytearray
    fill: np.ndarray


class HostRing:
    """`depth` host tensors of one shape, taken in turn: what a step wrote into one stays
    as it was until the device has read it, `depth` - 1 steps on at the latest (the
    engine runs at most max_concurrent_batches steps ahead of the device, as vLLM's
    UvaBufferPool assumes for its staged writes). Pinned on a GPU: the device reads them
    through their UVA view, or a non-blocking copy from one is one asynchronous call."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 depth: int):
        assert depth >= 2, depth
        self.pinned = device.type == "cuda"
        # one allocation: a kernel reads any buffer of it, chosen on the device (whole())
        self._whole = torch.zeros((depth, *shape), dtype=dtype, pin_memory=self.pinned)
        self._whole_view: torch.Tensor | None = None
        self._bufs = list(self._whole.unbind(0))
        self._np = [b.numpy() for b in self._bufs]
        self._views: list[torch.Tensor | None] = [None] * depth
        self._next = 0

    def __len__(self) -> int:
        return len(self._bufs)

    def take_index(self) -> int:
        """The next buffer's index (numpy(i) to write it, view(i) for the device)."""
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        return i

    def numpy(self, i: int) -> np.ndarray:
        return self._np[i]

    def view(self, i: int) -> torch.Tensor:
        """Buffer i as the device reads it: vLLM's UVA view on a GPU, made at first use
        (so tools that allocate tables and never stage a row,
        benchmarks/gpu/check_kernels.py, need no vLLM); the buffer itself elsewhere."""
        if not self.pinned:
            return self._bufs[i]
        view = self._views[i]
        if view is None:
            view = self._views[i] = self.whole()[i]
        return view

    def whole(self) -> torch.Tensor:
        """Every buffer, [depth, *shape], as the device reads them."""
        if not self.pinned:
            return self._whole
        if self._whole_view is None:
            from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

            self._whole_view = get_accelerator_view_from_cpu_tensor(self._whole)
        return self._whole_view


class Staging:
    """A step's changed rows (or single elements of the flattened block: width None)
    and their indices, in host rings the index copy reads (through their device view
    on a GPU)."""

    def __init__(self, rows: int, width: int | None, device: torch.device, depth: int):
        self.capacity = rows
        self._index = HostRing((rows,), torch.int64, device, depth)
        self._values = HostRing((rows, width) if width else (rows,), torch.int32, device,
                                depth)

    def stage(self, rows: np.ndarray, host: np.ndarray) -> tuple[int, int]:
        """The rows' indices and their host values, in the rings' next buffers (the index
        ring's turn names both: the values ring's own is never taken); (that index, how
        many rows)."""
        i = self._index.take_index()
        k = len(rows)
        self._index.numpy(i)[:k] = rows
        np.take(host, rows, axis=0, out=self._values.numpy(i)[:k])
        return i, k

    def views(self, i: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffer i's first k indices and values, as the device reads them."""
        return self._index.view(i)[:k], self._values.view(i)[:k]

    def rings(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every buffer's indices and values, as a kernel that picks one reads them."""
        return self._index.whole(), self._values.whole()


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
        # single elements (stage_runs): a request's position bitmaps are max_model_len / 32
        # words an entry, of which it sets a few, so its whole row, which a long
        # max_model_len makes hundreds of KiB, need not travel
        self.elements = Staging(ELEMENTS if self.stages_runs() else 1, None, device,
                                staging_depth)
        self._dirty: set[int] = set()
        self._runs: dict[int, list[np.ndarray]] = {}  # slot -> column runs [m, 2] to write
        self._groups: dict[tuple[int, ...], FieldGroup] = {}  # by the fields' offsets
        # staged, not yet on the device (apply(defer=True)): ((buffer, rows) of the rows'
        # rings or None, the same of the elements' or None)
        self._pending: tuple | None = None

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
            self._groups[key] = FieldGroup(runs, bytearray(b"\x01" * self.host.shape[0]),
                                           row[0])
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

    def stages_runs(self) -> bool:
        """Whether a family that can should stage the columns it sets, not whole rows."""
        return self.host[0].nbytes >= RUNS_FROM_BYTES

    # A family whose entries set few columns of their fields (a row family's sites and
    # the words of its position bitmaps that hold a set bit) claims a clean slot, writes
    # those columns on the host and stages only them; its release puts them back to the
    # inactive values, after which the slot is clean again.
    def claim_clean(self, slot: int, group: FieldGroup) -> bool:
        """Whether the slot's group columns are inactive (then claimed: the caller
        writes and stages its runs); False: the caller resets it (reset(claim=True))."""
        if not group.clean[slot]:
            return False
        group.clean[slot] = 0
        return True

    def stage_runs(self, slot: int, runs: np.ndarray) -> None:
        """Columns [lo, hi) of the slot's row, runs an int64 array [m, 2] of non-empty
        runs, for the next staged write (its whole row where it is staged whole too)."""
        self._runs.setdefault(slot, []).append(runs)

    def release_runs(self, slot: int, group: FieldGroup, runs: np.ndarray) -> None:
        """A slot claimed with claim_clean, whose entries wrote only `runs`: those columns
        back to their inactive values, staged; the slot is clean again."""
        host, fill = self.host[slot], group.fill
        for lo, hi in runs:
            host[lo:hi] = fill[lo:hi]
        group.clean[slot] = 1
        self.stage_runs(slot, runs)

    def apply(self, defer: bool = False) -> None:
        """The staged rows and column runs into the staging rings, and onto the device:
        now, or (`defer`) by whoever takes them (take_pending: the router's next graph
        replay, which applies them first) or else by flush(), before the step's forward
        and its routing read the block."""
        self.flush()  # a step that staged writes and never reached its forward
        elements = rows = None
        if self._runs:
            runs = {s: r for s, r in self._runs.items() if s not in self._dirty}
            self._runs.clear()
            if runs:
                # as many slots' runs as the element ring holds; the others' rows whole
                counts = np.fromiter((sum(int((r[:, 1] - r[:, 0]).sum()) for r in rs)
                                      for rs in runs.values()), np.int64, len(runs))
                fit = int(np.searchsorted(np.cumsum(counts), self.elements.capacity,
                                          side="right"))
                if fit < len(runs):
                    over = list(runs)[fit:]
                    self._dirty.update(over)
                    for slot in over:
                        del runs[slot]
                if runs:
                    elements = self.elements.stage(_elements(runs, self.host.shape[1]),
                                                   self.host.reshape(-1))
        if self._dirty:
            slots = np.fromiter(sorted(self._dirty), dtype=np.int64, count=len(self._dirty))
            self._dirty.clear()
            rows = self.staging.stage(slots, self.host)
        if elements is not None or rows is not None:
            self._pending = (rows, elements)
            if not defer:
                self.flush()

    def flush(self) -> None:
        """The pending staged writes as index copies (the reference of
        ops/stage_triton.py's kernels)."""
        if self._pending is None:
            return
        rows, elements = self._pending
        self._pending = None
        if elements is not None:
            self.gpu.view(-1).index_copy_(0, *self.elements.views(*elements))
        if rows is not None:
            self.gpu.index_copy_(0, *self.staging.views(*rows))

    def take_pending(self) -> tuple[int, int, int, int]:
        """The pending writes as ops/stage_triton.py's header (rows' buffer and count,
        elements' buffer and count; counts 0: none), now the taker's to apply."""
        rows, elements = self._pending or (None, None)
        self._pending = None
        return (*(rows or (0, 0)), *(elements or (0, 0)))
