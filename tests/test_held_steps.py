"""Whole steps held on the worker (hook_config hold_outputs_bytes,
HeldChunks.step_snapshots): a step whose rows all belong to held requests stays unsplit
until one of them goes; then it is split, with every older held step sharing a request,
so each request's chunks come home in step order; a request that left drops its rows
(and one that came back gets none from before); guards, the bound and a large step
split at once."""
from types import SimpleNamespace

import numpy as np
import torch

from graphtap.courier import CaptureStep, OverflowKind, RowFormat, StepRows, StepSnapshots
from graphtap.courier.chunks import HELD, positions_key
from graphtap.courier.held import Ending, StepBatch
from graphtap.courier.held_chunks import HeldChunks
from graphtap.courier.pack import unpack
from graphtap.courier.payload import open_chunks

NAME = "blocks.1.hook_resid_post"
END = Ending(frozenset({7}), cap=12, every_step=False)


class CountingStep(CaptureStep):
    splits = 0

    def _gathered(self):
        CountingStep.splits += 1
        return super()._gathered()


def step(rows: dict[str, list[int]], slots: dict[str, int]) -> CountingStep:
    """One step's host rows: per request its positions at NAME, each row's values its
    position (so a row says where it came from)."""
    labels = [(slots[r], 0, p) for r, ps in rows.items() for p in ps]
    lab = torch.tensor(labels, dtype=torch.int64)
    n = len(labels)
    count = torch.cat([torch.tensor([n]),
                       torch.bincount(lab[:, 0], minlength=max(slots.values()) + 1)])
    values = torch.tensor([[float(p)] * 4 for _, _, p in labels])
    formats = {slots[r]: {0: RowFormat(torch.float32, 4, None, 0)} for r in rows}
    return CountingStep(StepRows(values, lab, count, {slots[r]: r for r in rows}, formats,
                                 {0: NAME}, 1 << 20, OverflowKind.CAPTURE_ROWS))


def sampled(**tokens):
    return SimpleNamespace(req_ids=list(tokens), sampled_token_ids=list(tokens.values()))


def run(h, parts, after: dict[str, int], tokens: dict[str, list[int]], guards=None):
    snap = StepSnapshots(parts, guards, StepBatch(list(after), np.array(list(after.values()))),
                         h)
    return {r: open_chunks(p) for r, p in snap.per_request(sampled(**tokens)).items()}


def positions(chunks) -> list[list[int]]:
    return [unpack(c)[positions_key(NAME)].tolist() for c in chunks if HELD not in c]


SLOTS = {"a": 0, "b": 1, "c": 2}


def test_a_step_of_held_requests_stays_whole_until_one_of_them_goes():
    h = HeldChunks(1 << 20)
    for r in "ab":
        h.add_request(r, END)
    CountingStep.splits = 0
    part = step({"a": [0, 1, 2], "b": [0, 1]}, SLOTS)
    part._device = object()  # the device clones: they go now, the host rows stay
    assert run(h, [part], {"a": 3, "b": 2}, {"a": [4], "b": [4]}) == {}
    assert CountingStep.splits == 0 and part._device is None
    assert h.stats()["held_steps"] == 1 and h.stats()["held_chunk_bytes"] > 0
    # a stops: the held step is split, a's rows go in step order, b's stay held
    out = run(h, [step({"a": [3], "b": [2]}, SLOTS)], {"a": 4, "b": 3}, {"a": [7], "b": [4]})
    assert list(out) == ["a"] and positions(out["a"]) == [[0, 1, 2], [3]]
    assert out["a"][-1][HELD].tolist() == [4] and CountingStep.splits == 2
    assert h.stats()["held_steps"] == 0 and h.stats()["steps_kept_total"] == 1
    out = run(h, [step({"b": [3]}, SLOTS)], {"b": 4}, {"b": [7]})
    assert positions(out["b"]) == [[0, 1], [2], [3]]


def test_an_older_held_step_sharing_a_request_is_split_first():
    h = HeldChunks(1 << 20)
    for r in "abc":
        h.add_request(r, END)
    run(h, [step({"a": [0], "b": [0]}, SLOTS)], {"a": 1, "b": 1}, {"a": [4], "b": [4]})
    run(h, [step({"b": [1], "c": [0]}, SLOTS)], {"a": 1, "b": 2, "c": 1},
        {"a": [], "b": [4], "c": [4]})
    assert h.stats()["held_steps"] == 2
    # c stops: its step goes, and the one before (b's first rows) with it
    out = run(h, [], {"a": 1, "b": 2, "c": 2}, {"a": [4], "b": [4], "c": [7]})
    assert list(out) == ["c"] and positions(out["c"]) == [[0]]
    assert h.stats()["held_steps"] == 0
    out = run(h, [step({"a": [1], "b": [2]}, SLOTS)], {"a": 2, "b": 3}, {"a": [7], "b": [7]})
    assert positions(out["a"]) == [[0], [1]] and positions(out["b"]) == [[0], [1], [2]]


def test_a_request_that_left_gets_no_rows_from_before():
    h = HeldChunks(1 << 20)
    for r in "ab":
        h.add_request(r, END)
    run(h, [step({"a": [0, 1], "b": [0]}, SLOTS)], {"a": 2, "b": 1}, {"a": [4], "b": [4]})
    h.remove_request("a")  # preempted: its recomputation sends every position again
    h.add_request("a", END)
    out = run(h, [step({"a": [0, 1, 2]}, SLOTS)], {"a": 3}, {"a": [7]})
    assert positions(out["a"]) == [[0, 1, 2]]
    out = run(h, [], {"b": 2}, {"b": [7]})
    assert positions(out["b"]) == [[0]]
    h.add_request("c", END)
    run(h, [step({"c": [0]}, SLOTS)], {"c": 1}, {"c": [4]})
    h.remove_request("c")
    assert h.stats()["held_steps"] == 0  # nobody left to get its rows


def test_guards_and_the_bound_split_a_step_as_it_comes():
    h = HeldChunks(1 << 20)
    h.add_request("a", END)
    guard = {"a": (SimpleNamespace(stop=False), 0)}  # an annotating guard
    CountingStep.splits = 0
    assert run(h, [step({"a": [0]}, SLOTS)], {"a": 1}, {"a": [4]}, guards=guard) == {}
    assert CountingStep.splits == 1 and h.stats()["held_steps"] == 0
    small = HeldChunks(100)  # a step's copy is more than 100 bytes: every request goes
    small.add_request("a", END)
    out = run(small, [step({"a": [0, 1, 2, 3, 4, 5, 6, 7]}, SLOTS)], {"a": 8}, {"a": [4]})
    assert positions(out["a"]) == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert small.stats()["bound_sends_total"] == 1


def test_a_large_step_is_split_as_it_comes():
    h = HeldChunks(1 << 20, whole_step_bytes=64)  # the step's copy: 8 rows x 16 bytes
    h.add_request("a", END)
    CountingStep.splits = 0
    assert run(h, [step({"a": list(range(8))}, SLOTS)], {"a": 8}, {"a": [4]}) == {}
    assert CountingStep.splits == 1 and h.stats()["held_steps"] == 0
    assert h.stats()["chunks_kept_total"] == 1
    out = run(h, [], {"a": 9}, {"a": [7]})
    assert positions(out["a"]) == [list(range(8))]
