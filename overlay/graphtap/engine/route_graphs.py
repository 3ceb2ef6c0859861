"""The per-step routing's launches, captured once per token bucket as CUDA graphs.

A capturing step routes before the forward, on the engine core's host: one token
launch and, per row family, two fills and four kernels (ops/route_triton.py), each
launched from Python; where steps are host-bound (small models, decode steps that
capture) that host time is the step's (benchmarks/gpu/route_launch.py measures it). The
kernels read only fixed-address tables (the router stages the batch's layout and
positions into its own buffers, and the request count into a device scalar), and their
grids depend on the token count alone, so one captured graph per token bucket serves
every batch of up to that many tokens: a step replays one graph per routing instead of
launching its kernels.

Rows past the step's tokens up to the bucket are routed too: the token kernel maps them
to the sentinel slot (past the last request's tokens), which wants nothing, so they get
no buffer rows; the ops read only the step's rows.

A graph that routes tokens also stages their inputs first (`stages`): it copies the
layout from one buffer of the router's host ring (through its UVA view), and, once the
router knows the runner's positions buffer, the step's positions from it. So a step
routes in one replay, not a copy, a copy and a replay (each a distinct device call,
which after a quiet spell costs the engine core's host 0.1-0.2 ms: a burst's first
steps, benchmarks/gpu/first_step_host.py). One set per ring buffer: the host writes the
next step's layout while the device may not yet have read this one's.
"""
from __future__ import annotations

import bisect
import os
from typing import Callable

import torch

from graphtap.log import get_logger

logger = get_logger(__name__)

ENV = "GRAPHTAP_ROUTING_GRAPHS"  # "0": launch the routing kernels every step (the A/B)
# "0": the graphs leave the positions' copy to the router, a call of its own (the A/B)
POSITIONS_ENV = "GRAPHTAP_ROUTING_POSITIONS"
# "0": the slot block's staged writes stay an index copy of their own (the A/B)
SLOT_WRITES_ENV = "GRAPHTAP_ROUTING_SLOT_WRITES"


def buckets(max_tokens: int, block: int) -> list[int]:
    """Token counts a graph is captured for: the kernels' block, doubling, up to the
    step's most tokens (grids only differ by whole blocks; a bucket at most doubles the
    kernels' masked work, which is microseconds)."""
    out, b = [], block
    while b < max_tokens:
        out.append(b)
        b *= 2
    return out + [max_tokens]


def wanted(device: torch.device, backend) -> bool:
    return device.type == "cuda" and backend.device_counts and os.environ.get(ENV, "") != "0"


def copy_positions() -> bool:
    return os.environ.get(POSITIONS_ENV, "") != "0"


def apply_slot_writes() -> bool:
    return os.environ.get(SLOT_WRITES_ENV, "") != "0"


def cuda_graphs() -> Callable[[Callable[[], None]], "torch.cuda.CUDAGraph"]:
    """Capture one body as a CUDA graph (all in one memory pool: they allocate nothing)."""
    pool = torch.cuda.graph_pool_handle()

    def capture(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
        body()  # warm: every launch compiled and its arguments bound before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: vLLM's other threads may use CUDA meanwhile
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            body()
        return graph
    return capture


class RouteGraphs:
    """One engine's routing graphs: for each bucket and stage (ring buffer) the token
    routing, per row family (key) its row routing, and per row family and stage both in
    one graph. `tokens(n, stage)` / `rows(key, n)` / `tokens_and_rows(key, n, stage)`
    replay the smallest bucket of at least n tokens. `stages[i](b)`: what a replay on
    ring buffer i does before it routes b tokens. `capture` turns a body into something
    with `replay()` (CUDA graphs; the CPU tests run the bodies at the bucket's size
    instead)."""

    def __init__(self, sizes: list[int], tokens: Callable[[int], None],
                 rows: dict[int, Callable[[int], None]], capture=None,
                 stages: list[Callable[[int], None]] | None = None):
        capture = capture or cuda_graphs()
        stages = stages or [lambda b: None]
        self.sizes = sizes
        self._tokens = [[capture(lambda b=b, s=s: (s(b), tokens(b))) for b in sizes]
                        for s in stages]
        self._rows = {key: [capture(lambda b=b, f=fn: f(b)) for b in sizes]
                      for key, fn in rows.items()}
        # a step's token routing and one family's rows in one replay (a capturing step: a
        # graph replay costs ~70 us of the H200 host's busy loop)
        self._both = {key: [[capture(lambda b=b, f=fn, s=s: (s(b), tokens(b), f(b)))
                             for b in sizes] for s in stages]
                      for key, fn in rows.items()}

    def bucket(self, n: int) -> int:
        return bisect.bisect_left(self.sizes, n)

    def tokens(self, n: int, stage: int = 0) -> None:
        self._tokens[stage][self.bucket(n)].replay()

    def rows(self, key: int, n: int) -> None:
        self._rows[key][self.bucket(n)].replay()

    def tokens_and_rows(self, key: int, n: int, stage: int = 0) -> None:
        self._both[key][stage][self.bucket(n)].replay()

    @classmethod
    def build(cls, max_tokens: int, tokens: Callable[[int], None],
              rows: dict[int, Callable[[int], None]], capture=None,
              stages: list[Callable[[int], None]] | None = None) -> "RouteGraphs | None":
        """The graphs, or None (and a warning) where capture fails: the router then
        launches the same kernels every step, as without graphs."""
        from graphtap.ops.route_triton import BLOCK  # Triton only where it routes

        sizes = buckets(max_tokens, BLOCK)
        try:
            graphs = cls(sizes, tokens, rows, capture, stages)
        except RuntimeError as e:
            logger.warning("graphtap: routing graphs not captured (%s); the routing "
                           "launches its kernels every step", e)
            return None
        logger.info("graphtap: routing captured for %d token buckets up to %d, %d row "
                    "families, %d ring buffers", len(sizes), max_tokens, len(rows),
                    len(stages or [None]))
        return graphs
