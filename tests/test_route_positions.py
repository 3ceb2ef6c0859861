"""Which steps copy the batch's positions into the router's tok_pos (engine/manager.py
prepare_step): the z op and the staged row routing read them there; the residual
steering op reads the model's own, so a step that only steers the residual copies none
(on a GPU one launch less in every steered step). A step whose rows one family routes
hands the router that family's tables, whose routing a graph replays with the tokens'."""
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

H, L, PROMPT = 256, 512, 16


def manager():
    from graphtap.testing.hook_manager import cpu_hook_manager

    return cpu_hook_manager(["blocks.2.hook_resid_post", "blocks.1.attn.hook_z"], layers=4,
                            hidden=H, heads=4, kv_heads=2, head_dim=64, max_len=L,
                            max_num_seqs=8, batched_tokens=64, max_captures=4,
                            capture_rows=64)


class Recorder:
    """The router's calls from prepare_step, recorded (nothing routed)."""

    def __init__(self):
        self.positions, self.rows = [], []

    def route(self, input_batch, positions=True, rows=None):
        self.positions.append(positions)
        self.rows.append(rows)

    def route_rows(self, *args):
        pass

    def deactivate(self, force=False):
        self.positions.append(None)

    def invalidate(self):
        pass

    def takes_slot_writes(self):
        return False


def step(slot: int):
    """A request's prompt, alone in its step, in `slot`."""
    return NS(req_ids=["r"], num_reqs=1, num_tokens=PROMPT, num_tokens_after_padding=PROMPT,
              idx_mapping_np=np.array([slot], np.int32),
              num_computed_tokens_np=np.zeros(1, np.int32),
              num_scheduled_tokens=np.array([PROMPT], np.int32),
              query_start_loc_np=np.array([0, PROMPT], np.int32),
              positions=torch.arange(PROMPT), input_ids=torch.zeros(PROMPT, dtype=torch.int64))


VEC = [0.5] * H
HOOKS = {
    "none": (None, None),
    "steer": ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add", "vector": VEC,
                          "scale": 1.0}]}, False),
    "heads": ({"steer": [{"site": "blocks.1.attn.hook_z", "op": "add", "heads": [1],
                          "vector": [0.5] * 64, "scale": 1.0}]}, True),
    "capture": ({"capture": [{"site": "blocks.2.hook_resid_post",
                              "positions": "last_prompt"}]}, True),
    "steer+capture": ({"steer": [{"site": "blocks.2.hook_resid_post", "op": "add",
                                  "vector": VEC, "scale": 1.0}],
                       "capture": [{"site": "blocks.2.hook_resid_post",
                                    "positions": "last_prompt"}]}, True),
}


@pytest.mark.parametrize("mode", list(HOOKS))
def test_positions_are_copied_only_where_the_step_reads_them(mode):
    from vllm import SamplingParams

    hooks, copies = HOOKS[mode]
    m, frontend = manager()
    m.router = Recorder()
    params = SamplingParams(max_tokens=4, hooks=hooks)
    frontend.process_request("r", params, None, PROMPT)
    m.add_request(3, NS(req_id="r", prompt_len=PROMPT, sampling_params=params))
    m.apply_staged_writes()
    m.prepare_step(step(3), dummy_run=False)
    assert m.router.positions == [copies]
    captures = hooks is not None and "capture" in hooks
    assert m.router.rows == ([] if hooks is None else
                             [m.families[1].t if captures else None])
