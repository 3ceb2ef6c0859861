"""CPU benchmark of a graph op's dispatch alone (its body does nothing): registered as
graphtap registers its ops (ops/register.py, direct on a library) against
`torch.library.custom_op`, called through torch.ops under inference mode as vLLM's
forward calls them. Issue 18: a step that runs without a CUDA graph (a harvest's
2048-token prefill) calls every hook op's Python body once per layer, and the H200
profile of such a step showed the hook ops' host time beside vLLM's own kernels'
(benchmarks/results/README.md, session 23). Both are registered in one process, so the
pair is measured on one machine state."""
from typing import Optional

import pytest
import torch

from graphtap.ops.register import graph_op


def _noop(x: torch.Tensor, other: Optional[torch.Tensor], positions: torch.Tensor,
          site: int) -> None:
    return None


graph_op("bench_dispatch_noop_", mutates=("x",))(_noop)  # steer_resid_'s signature


@torch.library.custom_op("graphtap_bench::noop_", mutates_args=("x",))
def _custom(x: torch.Tensor, other: Optional[torch.Tensor], positions: torch.Tensor,
            site: int) -> None:
    return None


@_custom.register_fake
def _(x, other, positions, site) -> None:
    return None


OPS = {"direct": torch.ops.graphtap.bench_dispatch_noop_.default,
       "custom_op": torch.ops.graphtap_bench.noop_.default}


@pytest.mark.parametrize("registration", list(OPS))
def test_op_dispatch(benchmark, registration):
    op = OPS[registration]
    x, positions = torch.zeros(4, 8), torch.zeros(4, dtype=torch.int64)

    def call():
        with torch.inference_mode():
            for _ in range(100):  # one figure per 100 calls: a call is microseconds
                op(x, x, positions, 3)

    benchmark(call)
