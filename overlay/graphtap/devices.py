"""Whether this process can see a CUDA device, asked without poisoning fork.

`torch.cuda.is_available()` queries the device count through the CUDA runtime, which
marks the process as having initialised CUDA: a child forked afterwards (vLLM's engine
core, which vLLM forks unless it sees torch's CUDA state initialised) then fails with
"Cannot re-initialize CUDA in forked subprocess". Through NVML the same question leaves
CUDA alone (torch's PYTORCH_NVML_BASED_CUDA_CHECK)."""
from __future__ import annotations

import os

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    before = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"
    try:
        return torch.cuda.is_available()
    finally:
        if before is None:
            del os.environ[NVML_CHECK]
        else:
            os.environ[NVML_CHECK] = before
