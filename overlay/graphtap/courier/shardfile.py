"""A safetensors file written from tensors given in pieces, each piece's bytes streamed
straight to the file: the sink's shards are gigabytes made of many step pieces (views
of the pinned step buffers), and safetensors' own writers take whole tensors, so a
shard cost a concatenation and two more copies of every byte before the write (the
writer thread, not the disk, was the sink's limit on the H200 host). The format is
safetensors' own (an 8-byte little-endian header size, the JSON header padded to 8
bytes, then the data in header order); safetensors reads these files."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.int64: "I64", torch.int32: "I32"}


def write_pieces(path: str | Path, tensors: dict[str, list[torch.Tensor]],
                 metadata: dict[str, str] | None = None) -> None:
    """Each tensor of the file as the concatenation of its pieces along the first
    dimension (pieces of one tensor share dtype and the other dimensions)."""
    header, offset = {}, 0
    for name, pieces in tensors.items():
        first = pieces[0]
        if any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] for p in pieces):
            raise ValueError(f"{name}: pieces of different dtypes or shapes")
        size = sum(p.numel() * p.element_size() for p in pieces)
        header[name] = {"dtype": DTYPES[first.dtype],
                        "shape": [sum(p.shape[0] for p in pieces), *first.shape[1:]],
                        "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    buffers = [struct.pack("<Q", len(raw)), raw]
    buffers += [p.reshape(-1).view(torch.uint8).numpy() for pieces in tensors.values()
                for p in pieces if p.numel()]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, buffers)
    finally:
        os.close(fd)


def _write_all(fd: int, buffers: list, writev=os.writev) -> None:
    """The buffers in order, IOV_MAX at a time through writev: one call (and one GIL
    release) per batch, where a write per piece handed the GIL back and forth with the
    engine's thread (a shard of decode steps is a thousand pieces)."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        batch = views[:IOV_MAX]
        done = writev(fd, batch)
        if done == sum(len(v) for v in batch):
            del views[:len(batch)]
            continue
        while done >= len(views[0]):  # a short write: resume where it stopped
            done -= len(views.pop(0))
        views[0] = views[0][done:]


def split_pieces(chunks: list[torch.Tensor], rows: int) -> tuple[list, list]:
    """The pieces' first `rows` rows and the rest, as views (nothing copied): a shard
    cut where it is full."""
    head, at = [], 0
    for i, c in enumerate(chunks):
        if at + len(c) <= rows:
            head.append(c)
            at += len(c)
            continue
        if rows > at:
            head.append(c[:rows - at])
        return head, [c[rows - at:], *chunks[i + 1:]]
    return head, []
