"""What a benchmark ran on and what disturbed it: the GPU, vLLM's version (stock or
patched), and this process's garbage-collector pauses."""
from __future__ import annotations

import gc
import time


class GcPauses:
    """Times the garbage collector's pauses in this process while active (gc.callbacks):
    in-process AsyncLLM's output handling and the client share this process, so a long
    collection delays every running request's tokens at once."""

    def __init__(self):
        self.ms, self.full, self._t = 0.0, 0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.ms += (time.perf_counter() - self._t) * 1000
            self.full += info["generation"] == 2
            self._t = None

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:
        return "unknown"


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?") + (" (patched)" if _patched() else " (stock)")


def _patched() -> bool:
    try:
        import vllm.v1.worker.gpu.hooks  # noqa: F401

        return True
    except ImportError:
        return False
