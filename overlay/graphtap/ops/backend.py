"""The implementation of every op, picked once when an engine's hook manager starts:
torch references where there is no GPU (CPU, and the spec of truth in tests), Triton
kernels on a GPU. `GRAPHTAP_TORCH_ROUTING=1` keeps the per-step routing as torch ops on
GPUs too (the A/B of the routing kernels), read at that start only (the router's
CUDA graphs of the routing: engine/route_graphs.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from graphtap.ops.capture import capture_reference
from graphtap.ops.mass import mass_reference
from graphtap.ops.pattern import pattern_reference
from graphtap.ops.probe import probe_reference
from graphtap.ops.route import route_rows_reference, route_tokens_reference
from graphtap.ops.steer import steer_reference


@dataclass(frozen=True)
class Backend:
    """One engine's op implementations (see each op's module for its contract)."""

    name: str
    steer: Callable
    capture: Callable
    pattern: Callable
    route_tokens: Callable
    route_rows: Callable
    probe: Callable
    mass: Callable
    # the routing kernels read the step's request count from a device tensor (the
    # router stages it), so their launches can be captured as CUDA graphs
    device_counts: bool = False


TORCH = Backend("torch", steer_reference, capture_reference, pattern_reference,
                route_tokens_reference, route_rows_reference, probe_reference, mass_reference)


def _triton(torch_routing: bool) -> Backend:
    from graphtap.ops.capture_triton import capture_triton
    from graphtap.ops.mass_triton import mass_triton
    from graphtap.ops.pattern_triton import pattern_triton
    from graphtap.ops.probe_triton import probe_triton
    from graphtap.ops.route_triton import route_rows_triton, route_tokens_triton
    from graphtap.ops.steer_triton import steer_triton

    def capture(t, x, other, site, col=0):
        if not capture_triton(t, x, other, site, col):  # a layout the kernel cannot view
            capture_reference(t, x, other, site, col)

    if torch_routing:
        return Backend("triton+torch-routing", steer_triton, capture, pattern_triton,
                       route_tokens_reference, route_rows_reference, probe_triton, mass_triton)
    return Backend("triton", steer_triton, capture, pattern_triton, route_tokens_triton,
                   route_rows_triton, probe_triton, mass_triton, device_counts=True)


def select_backend(device: torch.device) -> Backend:
    if device.type != "cuda":
        return TORCH
    return _triton(os.environ.get("GRAPHTAP_TORCH_ROUTING", "") == "1")
