"""A safetensors file written from tensors given in pieces, each piece's bytes streamed
straight to the file: the sink's shards are gigabytes made of many step pieces (views
of the pinned step buffers), and safetensors' own writers take whole tensors, so a
shard cost a concatenation and two more copies of every byte before the write (the
writer thread, not the disk, was the sink's limit on the H200 host). The format is
safetensors' own (an 8-byte little-endian header size, the JSON header padded to 8
bytes, then the data in header order); safetensors reads these files."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

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
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for pieces in tensors.values():
            for p in pieces:
                if p.numel():
                    f.write(p.contiguous().reshape(-1).view(torch.uint8).numpy().data)
