"""CPU benchmark of the engine thread's half of the bulk sink: one capture step's rows
handed to the sink (CaptureStep.per_request with a sink tap), Llama-3-8B rows (4096
bf16) at every layer of 32, the writer replaced by one that only counts what it is handed (the
writer's threads are off the engine's path). Issue 18: a harvest's per-step host work
bounds its rows/s and the TPOT of the harvesting requests (H200 figures in
benchmarks/results/README.md)."""
import numpy as np
import pytest
import torch

from graphtap.courier import CaptureStep, OverflowKind, RowFormat, StepRows
from graphtap.engine.families.capture import SinkTap

WIDTH, SITES = 4096, 32
BF16 = RowFormat(torch.bfloat16, WIDTH, None, 0)


class CountingSink:
    """The writer's producer side at no cost: counts hand-overs and runs (the writer's
    own put is not the courier's)."""

    def __init__(self):
        self.handovers = self.runs = 0

    def put_runs(self, request, position, token, runs, ready=None):
        self.handovers += 1
        self.runs += len(runs)

    def flush(self):
        pass


def sink_step(reqs: int, tokens_each: int,
              whole: bool = True) -> tuple[CaptureStep, CountingSink]:
    """A step as the device writes it: site-major, each request's tokens adjacent.
    `whole`: the family says every entry of each request sinks (a harvest), so the
    courier finds the runs from the site labels alone; False: row by row (a step that
    also has rows going back with their requests takes that path)."""
    labels = torch.tensor([(r, s, 100 + t) for s in range(SITES) for r in range(reqs)
                           for t in range(tokens_each)])
    n = len(labels)
    count = torch.tensor([n] + [SITES * tokens_each] * reqs)
    step = CaptureStep(StepRows(torch.empty(n, WIDTH, dtype=torch.bfloat16), labels, count,
                                {r: f"r{r}" for r in range(reqs)},
                                {r: {s: BF16 for s in range(SITES)} for r in range(reqs)},
                                {s: f"blocks.{s}.hook_resid_post" for s in range(SITES)},
                                1 << 22, OverflowKind.CAPTURE_ROWS))
    writer = CountingSink()
    step.sink = SinkTap(writer, np.zeros((reqs + 1, SITES), np.int32), np.arange(reqs + 1),
                        (BF16,), {0}, whole=np.full(reqs + 1, whole) if whole else None)
    step.tokens = torch.zeros(n, dtype=torch.int64)
    return step, writer


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "row-by-row"])
@pytest.mark.parametrize("reqs,tokens_each", [(64, 1), (4, 512)],
                         ids=["decode64", "prefill-2048-tokens"])
def test_sink_step(benchmark, reqs, tokens_each, whole):
    step, writer = sink_step(reqs, tokens_each, whole)
    out = benchmark(step.per_request)
    assert out == {} and writer.runs == SITES * writer.handovers
