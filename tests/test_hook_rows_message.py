"""A step's large hook outputs travel after its tokens (patch 0008): the engine core's
output thread sends them as a message of their own right after the step's message,
the frontend keeps them for the request and does nothing else with them, and a request
that finishes in the step keeps its outputs in the step's message. Run through vLLM's
own output thread (EngineCoreProc.process_output_sockets) over a ZMQ socket into an
OutputProcessor, without an engine."""
import queue
import threading
from typing import Any, ClassVar

import pytest
import torch
import zmq
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.metrics.stats import IterationStats
from vllm.v1.outputs import HookPayload
from vllm.v1.serial_utils import MsgpackDecoder
from vllm.v1.worker.gpu.hooks import HookFrontend, split_hook_rows

from graphtap.courier.pack import unpack
from graphtap.courier.payload import INLINE_BYTES, open_payload
from helpers import engine_request


class Recorder(HookFrontend):
    def finish_outputs(self, request_id, chunks, num_tokens):
        return [(bytes(c.inline), {k: t.clone() for k, t in c.frames.items()}) for c in chunks]


def large(v: float) -> HookPayload:  # a value that travels as a frame
    return HookPayload(b"i%d" % v, {"k": torch.full((INLINE_BYTES // 4,), v)})


def small(v: float) -> HookPayload:  # inline only
    return HookPayload(b"s%d" % v)


def out(rid, tokens, hooks=None, finish=None):
    return EngineCoreOutput(request_id=rid, new_token_ids=tokens, hook_outputs=hooks,
                            finish_reason=finish)


def test_split_takes_large_outputs_of_requests_that_go_on_only():
    step = EngineCoreOutputs(engine_index=3, outputs=[
        out("a", [1], [large(1.0)]), out("b", [2], [large(2.0)], FinishReason.LENGTH),
        out("c", [3], [small(3.0)]), out("d", [4]), out("e", [5], [small(4.0), large(5.0)])])
    rows = split_hook_rows(step)
    assert rows.engine_index == 3
    assert [(o.request_id, o.new_token_ids, o.hooks_only) for o in rows.outputs] == \
        [("a", [], True), ("e", [], True)]
    assert [p.inline for p in rows.outputs[1].hook_outputs] == [b"s4", b"i5"]  # both, in order
    # the step keeps its tokens, the finishing request's and the small outputs
    assert [o.new_token_ids for o in step.outputs] == [[1], [2], [3], [4], [5]]
    assert [o.hook_outputs is None for o in step.outputs] == [True, False, False, True, True]
    assert not any(o.hooks_only for o in step.outputs)
    # a step without large outputs (every step of stock vLLM) stays one message
    plain = EngineCoreOutputs(outputs=[out("c", [3], [small(3.0)]), out("d", [4])])
    assert split_hook_rows(plain) is None and plain.outputs[0].hook_outputs is not None


@pytest.fixture
def output_thread(tmp_path):
    """vLLM's output thread sending to a PULL socket: (its queue, a receive function)."""
    path = f"ipc://{tmp_path}/out.sock"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(path)
    core = EngineCoreProc.__new__(EngineCoreProc)  # only its output thread runs
    core.output_queue = queue.Queue()
    thread = threading.Thread(target=core.process_output_sockets, args=([path], None, 0),
                              daemon=True)
    thread.start()
    decoder = MsgpackDecoder(EngineCoreOutputs)

    def receive() -> EngineCoreOutputs | None:
        if not pull.poll(5000):
            return None
        return decoder.decode(pull.recv_multipart(copy=False))

    yield core.output_queue, receive
    core.output_queue.put_nowait(EngineCoreProc.ENGINE_CORE_DEAD)
    thread.join(10)
    pull.close(linger=0)
    ctx.term()


def test_rows_follow_the_tokens_and_reach_the_finish_in_order(output_thread):
    send, receive = output_thread
    proc = OutputProcessor(None, log_stats=True, hooks=Recorder())
    for rid in ("a", "b"):
        proc.add_request(engine_request(rid, max_tokens=3), None)
    steps = [  # a: large rows at its first two steps; b: finishes with large rows
        [out("a", [7], [large(1.0)]), out("b", [7], [small(2.0)])],
        [out("a", [8], [large(3.0)]), out("b", [8], [large(4.0)], FinishReason.LENGTH)],
        [out("a", [9], [small(5.0)], FinishReason.LENGTH)]]
    for outputs in steps:
        send.put_nowait((0, EngineCoreOutputs(outputs=outputs)))
    messages = [receive() for _ in range(5)]
    assert None not in messages
    kinds = [[(o.request_id, o.hooks_only) for o in m.outputs] for m in messages]
    # each step's message, then its large rows of requests that go on
    assert kinds == [[("a", False), ("b", False)], [("a", True)],
                     [("a", False), ("b", False)], [("a", True)], [("a", False)]]
    finished, tokens_seen = {}, []
    for m in messages:
        stats = IterationStats()
        done = proc.process_outputs(m.outputs, m.timestamp, stats)
        tokens_seen.append(stats.num_generation_tokens)
        assert not m.outputs[0].hooks_only or not done.request_outputs  # no output of its own
        finished.update({o.request_id: o for o in done.request_outputs if o.finished})
    assert tokens_seen == [2, 0, 2, 0, 1]  # the rows' messages count no tokens
    assert list(finished["a"].outputs[0].token_ids) == [7, 8, 9]
    # every payload reached the finish, in the order of the steps, values intact
    got = {rid: [(inline, {k: t[0].item() for k, t in frames.items()})
                 for inline, frames in o.hooks] for rid, o in finished.items()}
    assert got == {"a": [(b"i1", {"k": 1.0}), (b"i3", {"k": 3.0}), (b"s5", {})],
                   "b": [(b"s2", {}), (b"i4", {"k": 4.0})]}
    assert finished["a"].metrics.num_generation_tokens == 3


class Gated(HookPayload, gc=True):
    """A deferred payload (courier/later.py's kind) whose settle waits for `gate`."""

    deferred: ClassVar[bool] = True
    gate: Any = None
    value: Any = None

    def settle(self) -> HookPayload:
        self.gate.wait(10)
        return self.value


def test_deferred_outputs_are_made_after_the_tokens_left(output_thread):
    send, receive = output_thread
    gate = threading.Event()
    send.put_nowait((0, EngineCoreOutputs(outputs=[
        out("a", [7], [Gated(gate=gate, value=large(1.0))]), out("b", [7])])))
    # the step's message arrives while its rows are still being made
    step = receive()
    assert step is not None and not gate.is_set()
    assert [(o.request_id, o.new_token_ids, o.hook_outputs) for o in step.outputs] == \
        [("a", [7], None), ("b", [7], None)]
    gate.set()
    rows = receive()
    assert [(o.request_id, o.hooks_only) for o in rows.outputs] == [("a", True)]
    (payload,) = rows.outputs[0].hook_outputs
    assert payload.inline == b"i1" and payload.frames["k"][0].item() == 1.0


def test_graphtap_s_deferred_split_reaches_the_finish_through_the_output_thread(
        output_thread):
    """graphtap's deferred payloads (courier/later.py), from a real step split, through
    vLLM's output thread into an OutputProcessor: the request that goes on gets its rows
    after the step's tokens, the finishing one inside the step's message, both byte for
    byte what the split made at once."""
    from graphtap.courier import RowFormat, StepSnapshots
    from helpers import capture_step

    send, receive = output_thread
    fmt = RowFormat(torch.bfloat16, 512, (0, 1, 2, 3), 128)  # k of 4 heads: 80 KiB a request
    labels = [(r, 1, p) for r in range(2) for p in range(80)]
    rows = torch.randn(len(labels), 512).to(torch.bfloat16)

    def step() -> StepSnapshots:
        return StepSnapshots([capture_step(rows, labels, len(labels), {0: "a", 1: "b"},
                                           {0: {1: fmt}, 1: {1: fmt}},
                                           {1: "blocks.0.attn.hook_k"})])

    now, later = step()._per_request(None), step().per_request(None)
    assert all(p.deferred for p in later.values())
    proc = OutputProcessor(None, log_stats=False, hooks=Recorder())
    for rid in "ab":
        proc.add_request(engine_request(rid, max_tokens=2), None)
    send.put_nowait((0, EngineCoreOutputs(outputs=[
        out("a", [7], [later["a"]]), out("b", [7], [later["b"]], FinishReason.LENGTH)])))
    send.put_nowait((0, EngineCoreOutputs(outputs=[out("a", [8], None, FinishReason.LENGTH)])))
    messages = [receive() for _ in range(3)]
    assert None not in messages
    assert [[(o.request_id, o.hooks_only) for o in m.outputs] for m in messages] == \
        [[("a", False), ("b", False)], [("a", True)], [("a", False)]]
    finished = {}
    for m in messages:
        done = proc.process_outputs(m.outputs, m.timestamp, None)
        finished.update({o.request_id: o for o in done.request_outputs if o.finished})
    for rid in "ab":
        ((inline, frames),) = finished[rid].hooks
        assert inline == bytes(now[rid].inline)
        assert frames.keys() == now[rid].frames.keys() and frames  # k travels as a frame
        assert all(torch.equal(frames[k], now[rid].frames[k]) for k in frames)


class ShippedRecorder(Recorder):
    """A frontend that splits the steps graphtap ships whole (courier/shipped.py)."""

    def __init__(self):
        from graphtap.courier.shipped import ShippedRows

        self.shipped = ShippedRows()

    def rows_arrived(self, request_id, payloads):
        return self.shipped.arrived(request_id, payloads)

    def finish_outputs(self, request_id, chunks, num_tokens):
        return super().finish_outputs(request_id, self.shipped.resolve(request_id, chunks),
                                      num_tokens)

    def release_request(self, request_id):
        self.shipped.release(request_id)


def test_a_shipped_step_reaches_every_request_though_its_carrier_was_aborted(output_thread):
    """graphtap ships a deferred step whole (HookPayload.ship): the step's first request
    in the rows' message carries the step, the others a marker of it. The output
    processor hands every rows' output to the frontend before it drops those of aborted
    requests (patch 0008): before, a carrier aborted in the frontend took the other
    requests' rows with it."""
    from graphtap.courier import RowFormat, StepSnapshots
    from graphtap.courier.later import Unsettled
    from helpers import capture_step

    send, receive = output_thread
    fmt = RowFormat(torch.bfloat16, 512, (0, 1, 2, 3), 128)  # k of 4 heads: 80 KiB a request
    labels = [(r, 1, p) for r in range(2) for p in range(80)]
    rows = torch.randn(len(labels), 512).to(torch.bfloat16)

    def step(unsettled=None) -> StepSnapshots:
        return StepSnapshots([capture_step(rows, labels, len(labels), {0: "a", 1: "b"},
                                           {0: {1: fmt}, 1: {1: fmt}},
                                           {1: "blocks.0.attn.hook_k"})], unsettled=unsettled)

    now, later = step()._per_request(None), step(Unsettled(ship=True)).per_request(None)
    proc = OutputProcessor(None, log_stats=False, hooks=ShippedRecorder())
    proc.hooks.shipped._live = proc.request_states.__contains__  # as the frontend's _finish
    for rid in "ab":
        proc.add_request(engine_request(rid, max_tokens=2), None)
    send.put_nowait((0, EngineCoreOutputs(outputs=[
        out("a", [7], [later["a"]]), out("b", [7], [later["b"]])])))
    send.put_nowait((0, EngineCoreOutputs(outputs=[out("b", [8], None, FinishReason.LENGTH)])))
    messages = [receive() for _ in range(3)]
    assert [[(o.request_id, o.hooks_only) for o in m.outputs] for m in messages] == \
        [[("a", False), ("b", False)], [("a", True), ("b", True)], [("b", False)]]
    assert messages[1].outputs[0].hook_outputs[0].frames  # a carries the step
    proc.process_outputs(messages[0].outputs, messages[0].timestamp, None)
    proc.abort_requests(["a"], internal=True)  # the client went away
    finished = {}
    for m in messages[1:]:
        done = proc.process_outputs(m.outputs, m.timestamp, None)
        finished.update({o.request_id: o for o in done.request_outputs if o.finished})
    ((inline, got),) = finished["b"].hooks  # opened and unpacked by the split
    assert inline == b""  # (shipped._owned)
    want = unpack(open_payload(now["b"]))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert proc.hooks.shipped.waiting() == 0  # nothing kept for a
