"""A step's split after its tokens have left (courier/later.py): which steps wait, and
that what they settle to is what the split made before, value for value."""
import pickle
import threading

import torch
from vllm.v1.outputs import HookPayload
from vllm.v1.worker.gpu.hooks import settle_hook_rows, split_hook_rows
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

from graphtap.courier import RowFormat, StepSnapshots
from graphtap.courier.chunks import ERROR, error_message
from graphtap.courier.held_chunks import HeldChunks
from graphtap.courier.later import LaterPayload, Unsettled
from graphtap.courier.payload import open_payload
from graphtap.courier.snapshot import DEFER_BYTES
from graphtap.profiling import HostClock
from helpers import capture_step

NAMES = {1: "blocks.0.attn.hook_k", 2: "blocks.1.attn.hook_k"}

K = RowFormat(torch.bfloat16, 512, (0, 1, 2, 3), 128)  # a k site of 4 heads, as qk asks


def qk_step(reqs: int = 3, positions: int = 80, idle: bool = True):
    """A prefill step of `reqs` requests capturing k at every position of 2 sites (rows
    written site-major, as the device does), and a request of the batch without rows."""
    labels = [(r, site, p) for site in (1, 2) for r in range(reqs) for p in range(positions)]
    rows = torch.randn(len(labels), 512).to(torch.bfloat16)
    slot_to_req = {r: f"r{r}" for r in range(reqs)} | ({reqs: "idle"} if idle else {})
    formats = {r: {1: K, 2: K} for r in range(reqs)}
    return rows, labels, slot_to_req, formats


def snapshots(step=None, **kw) -> StepSnapshots:
    rows, labels, slot_to_req, formats = step or qk_step()
    return StepSnapshots([capture_step(rows, labels, len(labels), slot_to_req, formats,
                                       NAMES)], **kw)


def opened(payload: HookPayload) -> dict:
    return {k: t.clone() for k, t in open_payload(payload).items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_large_step_settles_to_what_its_split_made_before():
    step = qk_step()
    assert step[0].numel() * 2 >= DEFER_BYTES
    now = snapshots(step)._per_request(None)
    later = snapshots(step).per_request(None)
    # every request that wanted rows gets one, as from the split made at once (the
    # request of the batch without rows gets none from either), and nothing is split
    # until the first settle
    assert later.keys() == now.keys() == {"r0", "r1", "r2"}
    assert all(isinstance(p, LaterPayload) and p.deferred for p in later.values())
    split = later["r0"].split
    assert split._made is None
    for req, p in later.items():
        settled = p.settle()
        assert not settled.deferred and p.settle() is settled  # once made, kept
        assert same(opened(settled), opened(now[req])), req
        assert any(t.nbytes >= 64 << 10 for t in settled.frames.values())  # k travels alone
    # the host copies went with the split, and each payload left it as it was settled
    assert split._snapshots is None and split._made == {}


def test_a_step_no_settle_makes_is_made_at_the_next_one():
    """A step whose requests are all mid-prefill: the scheduler keeps their payloads
    until a later output, and the step's pinned copy must not wait that long."""
    unsettled, clock = Unsettled(), HostClock()
    data = qk_step()
    first = snapshots(data, unsettled=unsettled, clock=clock).per_request(None)
    split = first["r0"].split
    assert split._made is None
    snapshots(qk_step(), unsettled=unsettled, clock=clock).per_request(None)  # the next step
    assert split._made is not None and split._snapshots is None
    now = snapshots(data)._per_request(None)
    assert same(opened(first["r0"].settle()), opened(now["r0"]))
    # made inside the next step's per_request, which counts its time: no split_later
    # phase of its own (the output thread's, which may run at the same time)
    assert [c[0] for c in clock.calls] == ["per_request", "per_request"]
    third = snapshots(qk_step(), clock=clock).per_request(None)
    third["r0"].settle()
    assert [c[0] for c in clock.calls][-1] == "split_later"


def test_what_waits_and_what_does_not():
    small = qk_step(reqs=1, positions=4)  # 8 rows: split at once, in the step's message
    assert not any(p.deferred for p in snapshots(small).per_request(None).values())
    assert snapshots(guards={"r0": (object(), 80)})._defers() is None  # it may stop one
    # a request the frontend may finish on a stop string keeps the whole step in its
    # message; so does an engine that holds chunks
    assert not any(p.deferred for p in snapshots(inline={"r1"}).per_request(None).values())
    held = snapshots(hold=HeldChunks(1 << 20))
    assert held._defers() is None
    assert all(p.deferred for p in snapshots(inline={"elsewhere"}).per_request(None).values())


def test_a_split_that_fails_fails_the_steps_requests_not_the_thread():
    snap = snapshots()
    later = snap.per_request(None)
    snap.parts[0].labels = None  # the split raises

    for p in later.values():
        got = open_payload(p)
        assert "could not split a step's rows (AttributeError" in error_message(got[ERROR])


class Counted(StepSnapshots):
    calls = 0

    def split_now(self):
        Counted.calls += 1
        return super().split_now()


def test_concurrent_settles_split_once():
    rows, labels, slot_to_req, formats = qk_step()
    later = Counted([capture_step(rows, labels, len(labels), slot_to_req, formats,
                                  NAMES)]).per_request(None)
    threads = [threading.Thread(target=p.settle) for p in later.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Counted.calls == 1


def out(rid, tokens, hooks=None, finish=None):
    return EngineCoreOutput(request_id=rid, new_token_ids=tokens, hook_outputs=hooks,
                            finish_reason=finish)


def test_vllm_moves_deferred_outputs_after_the_step_and_settles_the_finishing_ones():
    data = qk_step()
    later = snapshots(data).per_request(None)
    now = snapshots(data)._per_request(None)
    # a payload of the split for a request it gave nothing (none is made so: below)
    nothing = LaterPayload(req="idle", split=later["r0"].split)
    step = EngineCoreOutputs(outputs=[
        out("r0", [1], [later["r0"]]), out("r1", [2], [later["r1"]], FinishReason.STOP),
        out("r2", [3], [HookPayload(b"x"), later["r2"]]), out("idle", [4], [nothing])])
    rows = split_hook_rows(step)
    # the finishing request's is settled in place (the frontend finishes it on this
    # message); the others leave the step's message unsettled, in their order
    assert not step.outputs[1].hook_outputs[0].deferred
    assert same(opened(step.outputs[1].hook_outputs[0]), opened(now["r1"]))
    assert [o.hook_outputs for o in step.outputs if o.request_id != "r1"] == [None] * 3
    assert [o.request_id for o in rows.outputs] == ["r0", "r2", "idle"]
    assert rows.outputs[1].hook_outputs[0].inline == b"x"
    settled = settle_hook_rows(rows)
    # settled: every value made, and the request without rows is left out
    assert [o.request_id for o in settled.outputs] == ["r0", "r2"]
    assert not any(p.deferred for o in settled.outputs for p in o.hook_outputs)
    assert same(opened(settled.outputs[0].hook_outputs[0]), opened(now["r0"]))
    assert same(opened(settled.outputs[1].hook_outputs[1]), opened(now["r2"]))
    # a message whose every deferred payload came out empty is not sent
    idle = LaterPayload(req="idle", split=snapshots().per_request(None)["r0"].split)
    assert settle_hook_rows(split_hook_rows(EngineCoreOutputs(outputs=[
        out("idle", [4], [idle])]))) is None


def test_a_request_without_rows_that_finishes_does_not_split_the_step_before_its_tokens():
    """A qk prefill step of requests r0..r2 in a batch with a decoding request that
    wanted no rows and finishes in it (a burst's first request, at its last token, in
    one of the last prefill steps): it gets no payload, so the step's message leaves
    before the split, which the output thread then makes for r0..r2 alone. Before, it
    got a deferred payload that split_hook_rows settled in place, and the whole step's
    split ran before any of the step's tokens left (~5 ms a qk step on the H100)."""
    later = snapshots().per_request(None)
    assert "idle" not in later
    step = EngineCoreOutputs(outputs=[out("idle", [4], None, FinishReason.LENGTH)] + [
        out(r, [1], [p]) for r, p in later.items()])
    split = later["r0"].split
    rows = split_hook_rows(step)
    assert split._made is None  # nothing split before the step's message
    assert {o.request_id for o in rows.outputs} == {"r0", "r1", "r2"}
    assert len(settle_hook_rows(rows).outputs) == 3 and split._made == {}


def test_a_worker_of_its_own_process_sends_the_payloads_made():
    """vLLM's multiprocessing executor pickles the step's output to the engine core."""
    data = qk_step()
    now = snapshots(data)._per_request(None)
    sent = pickle.loads(pickle.dumps(snapshots(data).per_request(None),
                                     protocol=pickle.HIGHEST_PROTOCOL))
    assert sent.keys() == now.keys() and all(type(p) is HookPayload for p in sent.values())
    assert all(same(opened(sent[r]), opened(now[r])) for r in now)


class CopyEvent:
    """A stand-in for the event after a large step's rows reached the host on their own
    stream (LabelledStep._rows_to_cpu on a GPU): counts the waits for it."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


def test_a_deferred_step_leaves_its_tokens_before_its_rows_are_home():
    """On a GPU a large step's rows go home on a stream of their own, after vLLM's copy
    event (so the step's sampled tokens no longer wait for them): what per_request does
    before the step's tokens leave (the deferral, its requests and bytes, from the
    count) must not wait for the rows; the split, made later, waits for them once, and
    settles to what the split made before."""
    step = qk_step()
    snaps = snapshots(step)
    part, event = snaps.parts[0], CopyEvent()
    part.rows_ready = event  # the rows' copy still queued
    later = snaps.per_request(None)
    assert event.waits == 0 and all(isinstance(p, LaterPayload) for p in later.values())
    now = snapshots(step)._per_request(None)
    for req, p in later.items():
        assert same(opened(p.settle()), opened(now[req])), req
    assert event.waits == 1 and part.rows_ready is None  # once, at the split's first read
