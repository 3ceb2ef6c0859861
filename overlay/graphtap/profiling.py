"""Named host ranges for torch.profiler (benchmarks/gpu/profile_capture.py reads them),
at no cost when no profiler runs: torch.profiler.record_function costs a few
microseconds even then, and the hook manager opens several per step, on the critical
path of every request of the engine (benchmarks/cpu: test_named_range_off)."""
from __future__ import annotations

import contextlib

import torch

_OFF = contextlib.nullcontext()


def named(name: str):
    """`with named("graphtap.x"):` a profiler range while a profiler runs, else nothing."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _OFF
