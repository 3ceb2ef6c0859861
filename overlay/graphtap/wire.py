"""The `hooks` field of an OpenAI response choice: what the server writes for a finished
request's `HookOutputs`, and how the client reads it back. Importable without torch.

    {"blocks.2.hook_resid_post": {"dtype": "bfloat16", "shape": [11, 4096],
                                  "positions": [0, 1, ...], "data": "<base64>"}, ...}

`data` is base64 of the tensor's raw little-endian bytes, row-major. A request that asked
for `"encoding": "safetensors"` gets `{"encoding": "safetensors", "data": "<base64>"}`
instead: one safetensors file holding each site and its `<site>.positions`. Captures
withheld (a step overflowed its buffer, say) come as `{"error": "..."}`. A request with
`save_to` also gets `"saved_to"` (the file, relative to the server's save_root) or
`"save_error"` (why it was not written; the captures still come back).
"""
from __future__ import annotations

import base64
import sys

import numpy as np

from graphtap.outputs import HookOutputs

DTYPES = ("float32", "bfloat16", "float16")
_NUMPY = {"float32": np.float32, "float16": np.float16}


SAVE_KEYS = ("saved_to", "save_error", "guard")  # never site names ("blocks.", "probe:", ...)


def encode(outputs: HookOutputs) -> dict:
    """Server side (torch tensors in `outputs`)."""
    if outputs.error:
        return {"error": outputs.error}
    saved = {k: getattr(outputs, k) for k in SAVE_KEYS if getattr(outputs, k, None)}
    if outputs.encoding == "safetensors":
        from safetensors.torch import save

        tensors = {**outputs, **{f"{k}.positions": v for k, v in outputs.positions.items()}}
        return {"encoding": "safetensors", "data": base64.b64encode(save(tensors)).decode(),
                **saved}
    return {**{name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                      "positions": outputs.positions[name].tolist(),
                      "data": base64.b64encode(_bytes(t)).decode()}
               for name, t in outputs.items()}, **saved}


def _bytes(t) -> bytes:
    import torch

    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def decode(obj: dict | None, as_torch: bool | None = None) -> HookOutputs | None:
    """Client side: numpy arrays (bfloat16 upcast to float32, exactly), or torch tensors
    in their own dtype when torch is importable (`as_torch` None) or asked for."""
    if obj is None:
        return None
    if "error" in obj:
        return HookOutputs(error=obj["error"])
    saved = {k: obj[k] for k in SAVE_KEYS if k in obj}
    obj = {k: v for k, v in obj.items() if k not in SAVE_KEYS}
    torch = _torch(as_torch)
    if obj.get("encoding") == "safetensors":
        raw = base64.b64decode(obj["data"])
        if torch is not None:
            from safetensors.torch import load
        else:
            from safetensors.numpy import load
        tensors = load(raw)
        names = [k for k in tensors if not k.endswith(".positions")]
        return HookOutputs({k: tensors[k] for k in names},
                           {k: tensors[f"{k}.positions"] for k in names}, **saved)
    out = HookOutputs(**saved)
    for name, site in obj.items():
        out[name] = _array(site, torch)
        positions = np.asarray(site["positions"], dtype=np.int64)
        out.positions[name] = torch.from_numpy(positions) if torch is not None else positions
    return out


def _torch(as_torch: bool | None):
    if as_torch is False:
        return None
    if as_torch is None and "torch" not in sys.modules:
        try:
            import torch  # noqa: F401
        except ImportError:
            return None
    import torch

    return torch


def _array(site: dict, torch):
    dtype, shape = site["dtype"], tuple(site["shape"])
    if dtype not in DTYPES:
        raise ValueError(f"hooks: unknown dtype {dtype!r}")
    raw = base64.b64decode(site["data"])
    if torch is not None:
        if not raw:
            return torch.zeros(shape, dtype=getattr(torch, dtype))
        return torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(shape)
    if dtype == "bfloat16":  # numpy has no bfloat16: the same values, exactly, in float32
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(raw, dtype=np.dtype(_NUMPY[dtype]).newbyteorder("<")).reshape(shape)
