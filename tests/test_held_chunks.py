"""Step chunks held on the worker until the request may finish (hook_config
hold_outputs_bytes, courier/held_chunks.py): a held request's chunks stay until a step
that may finish it and then go home together, in step order, with HELD; requests
nobody holds pass; the bound, a guard's finish and a step without a batch send at once;
a request that leaves drops its chunks; several chunks travel in one payload; and the
frontend withholds the outputs of a request whose last send falls short."""
from types import SimpleNamespace

import numpy as np
import torch
from vllm import SamplingParams

from graphtap.courier import assemble
from graphtap.courier.chunks import FINISH, HELD, positions_key
from graphtap.courier.held import Ending, StepBatch
from graphtap.courier.held_chunks import HeldChunks, holds_outputs
from graphtap.courier.payload import open_chunks, open_payload, seal
from graphtap.spec import NormalisedSpec
from graphtap.spec.entries import CaptureEntry

NAME = "blocks.1.hook_resid_post"
END = Ending(frozenset({7}), cap=12, every_step=False)


def chunk(*positions: int) -> dict[str, torch.Tensor]:
    pos = torch.tensor(positions, dtype=torch.int64)
    return {NAME: pos.float()[:, None].repeat(1, 4), positions_key(NAME): pos}


def sampled(**tokens):
    return SimpleNamespace(req_ids=list(tokens), sampled_token_ids=list(tokens.values()))


def test_chunks_wait_for_a_step_that_may_finish_the_request():
    h = HeldChunks(1 << 20)
    h.add_request("a", END)
    # a's prompt in two chunked-prefill steps, then decoding; b is not held
    b = chunk(0)
    out = h.step({"a": chunk(0, 1, 2), "b": b}, StepBatch(["a", "b"], np.array([3, 1])),
                 sampled(a=[], b=[4]))
    assert list(out) == ["b"] and out["b"][0] is b
    out = h.step({"a": chunk(3, 4)}, StepBatch(["a"], np.array([5])), sampled(a=[4]))
    assert out == {} and h.stats()["held_chunk_bytes"] > 0
    out = h.step({}, StepBatch(["a"], np.array([6])), sampled(a=[4]))  # a step without rows
    assert out == {}
    out = h.step({"a": chunk(6)}, StepBatch(["a"], np.array([7])), sampled(a=[7]))  # stop
    sent = out["a"]
    assert [c[positions_key(NAME)].tolist() for c in sent[:-1]] == [[0, 1, 2], [3, 4], [6]]
    assert sent[-1][HELD].tolist() == [7]
    assert h.stats()["held_chunk_bytes"] == 0 and h.holds("a")


def test_the_length_cap_and_a_guards_finish_send_at_once():
    h = HeldChunks(1 << 20)
    h.add_request("a", END)
    h.add_request("g", END)
    batch = StepBatch(["a", "g"], np.array([11, 5]))
    out = h.step({"a": chunk(10), "g": {**chunk(4), FINISH: torch.ones(1, dtype=torch.int8)}},
                 batch, sampled(a=[4], g=[4]))
    assert set(out) == {"a", "g"}  # a reaches its cap (12 tokens); g's guard stops it
    assert out["a"][-1][HELD].tolist() == [11] and FINISH in out["g"][0]


def test_past_the_bound_every_held_request_of_the_step_goes():
    h = HeldChunks(100)
    h.add_request("a", END)
    h.add_request("b", END)
    batch = StepBatch(["a", "b"], np.array([3, 3]))
    assert h.step({"a": chunk(0, 1, 2)}, batch, sampled(a=[4], b=[4])) == {}  # 72 bytes
    out = h.step({"b": chunk(0, 1, 2)}, batch, sampled(a=[4], b=[4]))  # 144 > 100
    assert set(out) == {"a", "b"} and h.stats()["held_chunk_bytes"] == 0
    assert h.stats()["bound_sends_total"] == 2
    assert h.step({"a": chunk(3)}, batch, None)["a"][0][positions_key(NAME)].tolist() == [3]


def test_a_view_of_a_steps_copy_counts_the_whole_copy():
    """The split hands out views of the step's pinned copy: holding one keeps it all."""
    step_copy = torch.zeros(1000, 4)  # 16,000 bytes
    h = HeldChunks(10_000)
    h.add_request("a", END)
    out = h.step({"a": {NAME: step_copy[10:12], positions_key(NAME): torch.tensor([0, 1])}},
                 StepBatch(["a"], np.array([2])), sampled(a=[4]))
    assert "a" in out  # 16,016 bytes kept > 10,000: sent at once


def test_a_request_that_leaves_drops_its_chunks():
    h = HeldChunks(1 << 20)
    h.add_request("a", END)
    h.step({"a": chunk(0, 1)}, StepBatch(["a"], np.array([2])), sampled(a=[4]))
    h.remove_request("a")
    assert not h.holds("a") and h.stats()["held_chunk_requests"] == 0
    assert h.stats()["held_chunk_bytes"] == 0
    # its life after preemption starts empty
    h.add_request("a", END)
    out = h.step({"a": chunk(0, 1, 2)}, StepBatch(["a"], np.array([11])), sampled(a=[7]))
    assert [c.get(positions_key(NAME), torch.tensor([])).tolist() for c in out["a"]] == \
        [[0, 1, 2], []]


def test_who_is_held():
    spec = NormalisedSpec(capture=(CaptureEntry(1, "resid_post", NAME, "float32", None, "all"),))
    plain = SamplingParams(max_tokens=4)
    assert holds_outputs(spec, plain, 1 << 20)
    assert not holds_outputs(spec, plain, 0)  # the engine does not hold
    assert not holds_outputs(NormalisedSpec(), plain, 1 << 20)  # nothing to return
    assert not holds_outputs(spec, SamplingParams(max_tokens=4, stop=["\n"]), 1 << 20)


def test_held_chunks_travel_in_one_payload_and_come_apart_in_order():
    big = torch.arange(20000, dtype=torch.float32).reshape(-1, 4)  # a frame of its own
    chunks = [chunk(0, 1), {"k": big, positions_key("k"): torch.arange(5000)},
              {**chunk(2), FINISH: torch.ones(1, dtype=torch.int8)},
              {HELD: torch.tensor([3])}]
    payload = seal(*chunks)
    assert payload.finish and len(payload.frames) == 1
    back = open_chunks(payload)
    assert len(back) == 4 and FINISH in back[-1]
    for got, want in zip(back, chunks):
        want = {k: v for k, v in want.items() if k != FINISH}
        got = {k: v for k, v in got.items() if k != FINISH}
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    one = seal(chunk(5))
    assert open_chunks(one)[0].keys() == open_payload(one).keys()


def test_the_frontend_withholds_held_outputs_that_stop_short():
    sent = open_chunks(seal(chunk(0, 1, 2), chunk(3), {HELD: torch.tensor([4])}))
    done = assemble(sent, held_through=4)
    assert done.error is None and done.positions[NAME].tolist() == [0, 1, 2, 3]
    short = assemble(sent, held_through=9)  # the request ran on; nothing more came
    assert short.error.startswith("hooks:") and "through position 3 of 8" in short.error
