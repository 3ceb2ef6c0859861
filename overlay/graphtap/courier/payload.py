"""A request's hook outputs of one step as they travel from the worker to the frontend
(vLLM's HookPayload, patch 0005): values under INLINE_BYTES as one msgpack blob inside
the engine core's message, larger tensors as zero-copy frames of their own.

Why not a tensor per value: vLLM's msgpack hooks make a few torch calls per tensor on
each side, and every torch call releases the GIL. The engine core encodes its outputs on
a thread of its own while the busy loop prepares the next step in Python, so each
release handed the GIL to the loop for up to a switch interval: one step's outputs of 64
requests capturing 3 sites took 1.6 ms to encode beside a busy thread instead of 0.4 ms
(benchmarks/cpu/test_bench_delivery.py). A blob is encoded and decoded in msgspec's C
code, with no call back into Python and no release.

The worker-side courier (the split, guards, held rows) works on chunks (name -> tensor);
`seal` turns a request's chunk into its payload as the step's outputs leave the worker,
and the frontend `open`s each payload when the request finishes."""
from __future__ import annotations

import msgspec
import torch
from vllm.v1.outputs import HookPayload

from graphtap.courier.chunks import FINISH

# A value this large travels as a frame: below it, copying it into the message and out
# again costs less than a tensor's calls (and their GIL hand-overs) on both sides.
INLINE_BYTES = 64 << 10

# The dtypes the courier sends; anything else in a payload is refused, not looked up.
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}
_NAMES = {d: n for n, d in DTYPES.items()}


class Inline(msgspec.Struct, array_like=True, gc=False):
    """One value inside a payload's blob: its dtype's name, shape and bytes (a bytearray
    when decoded: a tensor made over read-only bytes would warn and could not be written)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytearray


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(dict[str, Inline])


# Several steps' chunks of a request in one payload (held_chunks.py): each key prefixed
# with its chunk's index and this separator, which no output name contains.
SEP = "\x1f"


def seal(*chunks: dict[str, torch.Tensor], all_inline: bool = False) -> HookPayload:
    """A request's chunk of one step, or its held chunks of several, as they travel;
    FINISH (a guard's stop) becomes the payload's `finish`, on which vLLM's scheduler
    finishes the request. `all_inline`: every value inside the message, however large (a
    request the frontend may finish on the step's tokens, by a stop string: a frame
    would go in a message after them, patch 0008, and miss the finish)."""
    inline: dict[str, Inline] = {}
    frames: dict[str, torch.Tensor] = {}
    items = chunks[0].items() if len(chunks) == 1 else \
        ((f"{i}{SEP}{key}", t) for i, chunk in enumerate(chunks) for key, t in chunk.items()
         if key != FINISH)
    finish = any(FINISH in chunk for chunk in chunks)
    for key, t in items:
        if key == FINISH:
            continue
        if t.nbytes >= INLINE_BYTES and not all_inline:
            frames[key] = t
        else:
            inline[key] = Inline(_NAMES[t.dtype], tuple(t.shape), _raw(t))
    return seal_values(inline, frames, finish)


def seal_values(inline: dict[str, Inline], frames: dict[str, torch.Tensor] | None = None,
               finish: bool = False) -> HookPayload:
    """The payload of values already made (Inline: courier/direct.py makes them from
    numpy views, no tensors) and frames."""
    return HookPayload(_ENCODER.encode(inline) if inline else b"", frames or {}, finish)


def _raw(t: torch.Tensor) -> memoryview:
    """t's bytes in row-major order, a view where t is contiguous (the encoder copies
    them into the blob at once). Through numpy, where a reshape and a view were two
    torch calls per value, each a GIL hand-over (is_contiguous and numpy are none);
    bfloat16, which numpy lacks, as int16: one."""
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype is torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy().reshape(-1) if t.numel() else b"")


def open_chunks(payload: HookPayload) -> list[dict[str, torch.Tensor]]:
    """The chunks a payload was sealed from, in order."""
    chunk = open_payload(payload)
    if not any(SEP in key for key in chunk):
        return [chunk]
    chunks: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in chunk.items():
        if key == FINISH:  # the payload's, not a chunk's: the last one carries it
            continue
        i, name = key.split(SEP, 1)
        chunks.setdefault(int(i), {})[name] = t
    out = [chunks[i] for i in sorted(chunks)]
    if FINISH in chunk:
        out[-1][FINISH] = chunk[FINISH]
    return out


def open_payload(payload: HookPayload) -> dict[str, torch.Tensor]:
    """A payload's values by key (of a single chunk: the chunk it was sealed from):
    inline values first (tensors over their own decoded bytes), then the frames. A
    deferred payload (courier/later.py) is settled first: an in-process engine has no
    output thread that would have."""
    payload = payload.settle()
    out: dict[str, torch.Tensor] = {}
    if payload.inline:
        for key, v in _DECODER.decode(payload.inline).items():
            dtype = DTYPES.get(v.dtype)
            if dtype is None:
                raise ValueError(f"graphtap: a hook payload's {key!r} has dtype {v.dtype!r}")
            t = torch.frombuffer(v.data, dtype=dtype) if v.data else torch.empty(0, dtype=dtype)
            out[key] = t.view(v.shape)
    out.update(payload.frames)
    if payload.finish:
        out[FINISH] = torch.ones(1, dtype=torch.int8)
    return out


def own(t: torch.Tensor, within: int = 0) -> torch.Tensor:
    """t in storage of its own, or in one of at most `within` bytes: a request's values
    together, which may share storage among themselves (a step's pack of its sites) but
    never keep alive more than as much again. A single-chunk capture can still be a
    view of a whole step's rows (the worker splits steps into views; in-process engines
    pass them on unserialised), which would keep that step alive as long as the caller
    keeps this."""
    if owns(t) or (t.is_contiguous() and t.untyped_storage().nbytes() <= within):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def owns(t: torch.Tensor) -> bool:
    """Whether t is contiguous in storage of exactly its own size (own copies nothing)."""
    return t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
