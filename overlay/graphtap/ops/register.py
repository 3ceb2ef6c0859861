"""How graphtap's graph ops meet torch's dispatcher: defined and implemented on a library
of their own directly, as vLLM registers its own ops (vllm.utils.torch_utils.
direct_register_custom_op), not with `torch.library.custom_op`.

Why: a step that runs without a CUDA graph (every prefill step larger than the largest
captured size) calls each hook op's Python body once per layer, and custom_op wraps
each call in Python dispatch logic of its own (autograd and mutation checks) that costs
several times a plain dispatch; those calls sat on the host's path of a harvest's
2048-token prefill steps, which the host, not the device, paced
(benchmarks/cpu/test_bench_ops.py: test_op_dispatch). Forward passes run under
inference mode and no op is ever differentiated, so nothing of that logic is needed.

The schema is inferred from the Python signature (mutated arguments marked), the same
body serves the CPU and CUDA keys (an engine's device is known only when it starts),
and the fake implementation returns nothing: every op mutates in place and returns
None."""
from __future__ import annotations

from typing import Callable

import torch
from torch.library import Library, infer_schema

# Ops live as long as their library object: one for the process, like the op names.
_LIB = Library("graphtap", "FRAGMENT")
KEYS = ("CPU", "CUDA")


def graph_op(name: str, mutates: tuple[str, ...]) -> Callable[[Callable], Callable]:
    """Registers the decorated function as `graphtap::{name}` (called as
    torch.ops.graphtap.{name}); returns the function unchanged."""

    def register(fn: Callable) -> Callable:
        _LIB.define(name + infer_schema(fn, mutates_args=mutates))
        for key in KEYS:
            _LIB.impl(name, fn, key)
        torch.library.register_fake(f"graphtap::{name}", _returns_none, lib=_LIB)
        return fn

    return register


def _returns_none(*args, **kwargs) -> None:
    return None
