"""The courier's host side, without an engine: what the output path does to captures."""
import torch

from graphtap.frontend import GraphtapFrontend
from graphtap.outputs import HookOutputs
from graphtap.spec import ModelShape

SHAPE = ModelShape(num_layers=4, hidden_size=8, max_model_len=64,
                   configured_sites={"blocks.1.hook_resid_post"}, max_steers=2, max_vectors=4,
                   max_captures=2, num_heads=2, num_kv_heads=2, save_root=None)
SITE = "blocks.1.hook_resid_post"


def finished(rows, pos):
    return GraphtapFrontend(SHAPE).finish_outputs(
        "r", [{SITE: rows[:2], f"{SITE}@positions": pos[:2]},
              {SITE: rows[2:], f"{SITE}@positions": pos[2:]}])


def test_rows_in_position_order_and_the_last_repeat_wins():
    rows = torch.arange(5.0)[:, None].expand(5, 8)
    out = finished(rows, torch.tensor([0, 1, 2, 3, 4]))  # the usual case: in order
    assert out.positions[SITE].tolist() == [0, 1, 2, 3, 4] and out[SITE][:, 0].tolist() == \
        [0, 1, 2, 3, 4]
    # Recomputed after preemption: positions 1 and 2 ran twice; the later rows win.
    out = finished(rows, torch.tensor([1, 2, 0, 1, 2]))
    assert out.positions[SITE].tolist() == [0, 1, 2] and out[SITE][:, 0].tolist() == [2, 3, 4]


def test_merged_request_outputs_keep_the_hooks():
    """AsyncLLM merges outputs the consumer has not read (RequestOutput.add); the hooks
    ride on the finished one and must survive the merge (patch 0009)."""
    from vllm.outputs import CompletionOutput, RequestOutput

    def output(n, hooks, finished):
        done = CompletionOutput(0, "", list(range(n)), None, None)
        return RequestOutput("r", None, [1, 2], None, [done], finished, hooks=hooks)

    hooks = HookOutputs({SITE: torch.ones(3, 8)}, {SITE: torch.arange(3)})
    first = output(1, None, False)
    first.add(output(2, hooks, True), aggregate=False)
    assert first.finished and first.hooks is hooks
    later = output(3, None, True)  # a later output without hooks keeps what came
    first.add(later, aggregate=False)
    assert first.hooks is hooks


def test_results_own_their_storage():
    """A one-chunk capture that is a view of a whole step must not keep the step alive."""
    step = torch.randn(100, 8)
    out = GraphtapFrontend(SHAPE).finish_outputs(
        "r", [{SITE: step[10:13], f"{SITE}@positions": torch.tensor([4, 5, 6])}])
    assert out[SITE].untyped_storage().nbytes() == 3 * 8 * 4
    torch.testing.assert_close(out[SITE], step[10:13])
