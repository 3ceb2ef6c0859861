"""Rows held on the worker until the request may finish (courier/held.py): when they go
home, that they go home whole and labelled by the step's own batch (slots are reused),
what a request that leaves drops, the bound on held bytes, stopping guards, and the
frontend's refusal of rows that stop short of the request's length."""
from types import SimpleNamespace

import numpy as np
import torch
from vllm import SamplingParams

from graphtap.courier import assemble
from graphtap.courier.chunks import HELD, positions_key
from graphtap.courier.held import Ending, HeldRows, StepBatch
from graphtap.courier.payload import open_payload, seal
from graphtap.spec.entries import GuardEntry

NAME = "probe:blocks.1.hook_resid_post"
NEVER = Ending(frozenset(), cap=10_000, every_step=False)


def step_rows(slot_pos: list[tuple[int, int]], width: int = 2, site: int = 1):
    labels = np.array([(s, site, p) for s, p in slot_pos], np.int64).reshape(-1, 3)
    rows = np.array([[p + s / 10, -p] + [0.0] * (width - 2) for s, p in slot_pos],
                    np.float32).reshape(-1, width)
    return labels, rows


def held(*reqs, ending=NEVER):
    h = HeldRows({1: NAME})
    for r in reqs:
        h.add_request(r, {1: 2}, ending)
    return h


def sampled(**tokens):
    return SimpleNamespace(req_ids=list(tokens), sampled_token_ids=list(tokens.values()))


def test_ending_reads_vllms_stop_conditions():
    params = SamplingParams(max_tokens=5, stop_token_ids=[9])
    params.update_from_generation_config({}, eos_token_id=2)
    end = Ending.of(params, prompt_len=10, max_model_len=64)
    assert end.stops == {2, 9} and end.cap == 15 and not end.every_step
    assert end.may_finish([2], 12) and end.may_finish([9], 12) and end.may_finish([4], 15)
    assert not end.may_finish([4], 14) and not end.may_finish([], 14)
    quiet = SamplingParams(max_tokens=100, ignore_eos=True)
    quiet.update_from_generation_config({}, eos_token_id=2)
    assert Ending.of(quiet, 10, 64).stops == set() and Ending.of(quiet, 10, 64).cap == 64
    assert Ending.of(SamplingParams(stop=["\n"]), 10, 64).every_step


def test_rows_come_home_whole_when_the_request_may_finish():
    h = held("a", "b", ending=Ending(frozenset({7}), cap=10_000, every_step=False))
    batch = StepBatch(["a", "b"], np.array([5, 9]))
    for pos in range(4):
        h.add(*step_rows([(0, pos), (1, pos + 3)]), {0: "a", 1: "b"})
        assert h.due(batch, sampled(a=[3], b=[4])) == []
    assert h.due(batch, sampled(a=[3], b=[7])) == ["b"]
    out = h.flush(["b"], {"b": 9})
    assert list(out) == ["b"] and out["b"][HELD].tolist() == [9]
    assert out["b"][positions_key(NAME)].tolist() == [3, 4, 5, 6]
    torch.testing.assert_close(out["b"][NAME][:, 1], -torch.tensor([3.0, 4, 5, 6]))
    assert h.stats()["held_requests"] == 2  # b is held until vLLM frees it
    rest = h.flush(["a"], {"a": 5})
    assert rest["a"][positions_key(NAME)].tolist() == [0, 1, 2, 3]
    assert h.stats()["held_bytes"] == 0


def test_a_reused_slot_is_labelled_by_the_steps_own_batch():
    h = held("a")
    h.add(*step_rows([(0, 0), (0, 1)]), {0: "a"})
    h.remove_request("a")  # a finished; b takes slot 0
    h.add_request("b", {1: 2}, NEVER)
    h.add(*step_rows([(0, 5)]), {0: "a"})  # a step that ran before a left: dropped
    h.add(*step_rows([(0, 6)]), {0: "b"})
    out = h.flush(["b", "a"], {"b": 7})
    assert list(out) == ["b"] and out["b"][positions_key(NAME)].tolist() == [6]
    assert h.stats() == {"held_requests": 1, "held_bytes": 0}


def test_held_bytes_past_the_bound_send_the_whole_batch():
    h = held("a", "b")
    h.max_bytes = 64
    batch = StepBatch(["a", "b"], np.array([3, 3]))
    h.add(*step_rows([(0, 0), (1, 0)]), {0: "a", 1: "b"})
    assert h.due(batch, sampled(a=[1], b=[1])) == []
    h.add(*step_rows([(0, 1), (1, 1), (0, 2), (1, 2)]), {0: "a", 1: "b"})
    assert h.due(batch, sampled(a=[1], b=[1])) == ["a", "b"]
    assert h.due(batch, None) == ["a", "b"]  # no step output: nothing can be foreseen


def test_a_stopping_probe_guard_flags_generated_rows_only():
    h = held("a", "b", "c")
    stop = GuardEntry(kind="probe", threshold=2.5, stop=True, sources=(NAME,))
    note = GuardEntry(kind="probe", threshold=2.5, stop=False, sources=(NAME,))
    labels, rows = step_rows([(0, 2), (0, 3), (1, 3), (2, 4)])
    guards = {"a": (stop, 4), "b": (stop, 2), "c": (note, 0)}
    # a's row at 3 scores 3.0 but is a prompt row; b's is generated; c only annotates
    assert h.flagged(labels, rows, {0: "a", 1: "b", 2: "c"}, guards) == ["b"]


def test_the_frontend_withholds_rows_that_stop_short():
    rows = {NAME: torch.ones(2, 2), positions_key(NAME): torch.tensor([4, 5])}
    done = assemble([{**rows, HELD: torch.tensor([6])}], held_through=6)
    assert done.error is None and done.positions[NAME].tolist() == [4, 5]
    short = assemble([{**rows, HELD: torch.tensor([6])}], held_through=8)
    assert short.error.startswith("hooks:") and "through position 5 of 7" in short.error
    assert assemble([], held_through=3).error.startswith("hooks:")


def test_a_chunk_without_rows_serialises_through_vllm():
    """A request whose probe wanted no row that ran (it ended at its first token) gets
    an empty chunk: numpy hands empty selections stride 0, vLLM's msgpack encoder could
    not view such a tensor as bytes, and the engine core's output thread died of it."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    h = held("a", "b")
    h.add(*step_rows([(1, 4)]), {1: "b"})
    chunks = h.flush(["a", "b"], {"a": 3, "b": 5})
    assert chunks["a"][NAME].shape == (0, 2) and chunks["a"][positions_key(NAME)].shape == (0,)
    out = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=r, new_token_ids=[1],
                                                      hook_outputs=[seal(c)])
                                     for r, c in chunks.items()])
    back = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(out))
    got = {o.request_id: open_payload(o.hook_outputs[0]) for o in back.outputs}
    assert got["a"][positions_key(NAME)].numel() == 0
    assert got["b"][positions_key(NAME)].tolist() == [4]
