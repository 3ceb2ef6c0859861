"""Pinned host memory reserved once for the bulk sink's step copies (issue 18). A sink
step's rows are copied off the device into a block cut from it, handed to the writer as
views, and the block goes back once every byte handed over is written. Without it each
step copy took a block from torch's caching host allocator, which grows by pinning new
memory in the engine's thread (a harvest's first burst on the H200 host ran 4-8x slower
than the next) and rounds every block up to a power of two.

Not thread-safe: the sink writer calls it under its own lock. Blocks are first-fit in
offset order; frees coalesce with their neighbours."""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

ALIGN = 1 << 12  # blocks start on a page: any dtype views them, DMA likes them


@dataclass
class Block:
    """A live block: its size, and how many of its bytes the writer has to write."""

    size: int
    handed: int | None = None  # bytes handed to the writer (None: the step has not said)
    written: int = 0  # of those, bytes written and released


class Staging:
    """`nbytes` of host memory (pinned in place with cudaHostRegister where `pin`: an
    exact size, where the caching allocator would round 40 GiB up to 64)."""

    def __init__(self, nbytes: int, pin: bool = False):
        self.size = nbytes - nbytes % ALIGN
        if self.size < ALIGN:
            raise ValueError(f"sink staging: {nbytes} bytes is less than a page")
        self.buf = torch.empty(self.size, dtype=torch.uint8)
        self.base = self.buf.data_ptr()
        self.pinned = False
        if pin:
            # 1: cudaHostRegisterPortable, as torch's own cuda/_pin_memory_utils.py
            err = torch.cuda.cudart().cudaHostRegister(self.base, self.size, 1)
            if int(err) != 0:
                raise RuntimeError(f"sink staging: cudaHostRegister of {self.size} bytes "
                                   f"failed ({err})")
            self.pinned = True
        self._holes: list[list[int]] = [[0, self.size]]  # free [offset, size], by offset
        self._blocks: dict[int, Block] = {}  # offset -> live block
        self._starts: list[int] = []  # live offsets, sorted (a pointer's block by bisect)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base)
            self.pinned = False

    # ------------------------------------------------------------------ blocks
    def take(self, nbytes: int) -> int | None:
        """A block of at least `nbytes` (its offset), or None when no hole fits."""
        size = -(-nbytes // ALIGN) * ALIGN
        for i, (offset, room) in enumerate(self._holes):
            if room >= size:
                if room == size:
                    del self._holes[i]
                else:
                    self._holes[i] = [offset + size, room - size]
                self._blocks[offset] = Block(size)
                bisect.insort(self._starts, offset)
                return offset
        return None

    def view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """The block at `offset` as a tensor of `like`'s dtype and shape."""
        nbytes = like.numel() * like.element_size()
        return self.buf[offset:offset + nbytes].view(like.dtype).view(like.shape)

    def freeable(self) -> bool:
        """Whether a live block will be freed by writes alone (its step has settled)."""
        return any(b.handed is not None for b in self._blocks.values())

    def idle(self) -> bool:
        return not self._blocks

    def settle(self, offset: int, handed: int) -> bool:
        """The step is done with its block: `handed` bytes of it went to the writer
        (releases may have come before). Whether the block is free now."""
        block = self._blocks[offset]
        block.handed = handed
        return self._maybe_free(offset, block)

    def release(self, ptr: int, nbytes: int) -> bool:
        """`nbytes` at host address `ptr` were written (a chunk of a shard). False when
        they are not in a block here (a cast's copy, torch's allocator)."""
        at = ptr - self.base
        if not 0 <= at < self.size:
            return False
        i = bisect.bisect_right(self._starts, at) - 1
        if i < 0 or at >= self._starts[i] + self._blocks[self._starts[i]].size:
            raise RuntimeError(f"sink staging: {nbytes} bytes at offset {at} released "
                               f"outside a live block")
        offset = self._starts[i]
        block = self._blocks[offset]
        block.written += nbytes
        return self._maybe_free(offset, block)

    def _maybe_free(self, offset: int, block: Block) -> bool:
        if block.handed is None or block.written < block.handed:
            return False
        del self._blocks[offset]
        self._starts.remove(offset)
        i = bisect.bisect(self._holes, [offset, 0])
        self._holes.insert(i, [offset, block.size])
        # coalesce with the hole after, then the one before
        if i + 1 < len(self._holes) and offset + block.size == self._holes[i + 1][0]:
            self._holes[i][1] += self._holes.pop(i + 1)[1]
        if i and self._holes[i - 1][0] + self._holes[i - 1][1] == offset:
            self._holes[i - 1][1] += self._holes.pop(i)[1]
        return True
