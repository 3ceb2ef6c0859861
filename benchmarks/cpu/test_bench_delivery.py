"""CPU benchmark of the deliver phase of a capturing request's first token: one step's
per-request chunks (CaptureStep.per_request, as the worker makes them), sealed into
HookPayloads (courier/payload.py) and carried by vLLM's EngineCoreOutputs through its
own msgpack encoder and decoder, the path from the engine core to the frontend (the ZMQ
hop itself left out; frames are copied once, as a receive would). Issue 18: on the
H200, requests capturing with their prefill step reached their first token later than
idle ones, deliver +6 ms for 64 hs requests and +18 ms for 64 qk ones in session 19
(benchmarks/results/README.md, `llama3-8b-ttft`); this is the part of it that a change
to the chunks' layout or their encoding moves, measured per step here. (Not measured
here: beside a busy thread, each torch call of vLLM's tensor hooks could wait a switch
interval for the GIL, which sealing removed.)"""
import threading
import time

import pytest
import torch
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from graphtap.courier.pack import unpack
from graphtap.courier.payload import open_payload, seal
from test_bench_ops import mixed_qk_step, step_snapshot

# hs: resid_post at 3 layers, the last prompt token (8 KiB rows); qk: q at the last
# prompt token and k at every one of 256, 4 layers x 4 heads (step_snapshot's loads)
LOADS = {"hs": ("dump", 1), "qk": ("qk", 256)}


def deliver(encoder, decoder, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
    frames = encoder.encode(outputs)
    return decoder.decode([bytes(f) for f in frames])


@pytest.mark.parametrize("load,reqs", [("idle", 64), ("hs", 16), ("hs", 64), ("qk", 16)],
                         ids=["idle64", "hs16", "hs64", "qk16"])
def test_deliver_step(benchmark, load, reqs):
    chunks = {} if load == "idle" else step_snapshot(reqs, LOADS[load][1],
                                                     LOADS[load][0]).per_request()
    outputs = EngineCoreOutputs(outputs=[
        EngineCoreOutput(request_id=f"r{r}", new_token_ids=[5],
                         hook_outputs=[seal(chunks[f"r{r}"])] if chunks else None)
        for r in range(reqs)])
    back = benchmark(deliver, MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs), outputs)
    assert len(back.outputs) == reqs
    if chunks:
        sent, got = unpack(chunks["r0"]), unpack(open_payload(back.outputs[0].hook_outputs[0]))
        assert sent.keys() == got.keys() and all(torch.equal(sent[k], got[k]) for k in sent)


@pytest.mark.parametrize("sealed", [False, True], ids=["tensors", "sealed"])
def test_encode_beside_a_busy_thread(benchmark, sealed):
    """The engine core encodes a step's outputs on its output thread while its busy loop
    runs Python: vLLM's tensor hooks make torch calls that release the GIL, and each
    release let the loop keep it for a while. 64 hs requests of one decode step, as
    tensors (before payload.py) or sealed, encoded beside a thread that runs Python with
    short waits (the loop's GPU syncs)."""
    chunks = step_snapshot(64, 1, "dump").per_request()
    outputs = EngineCoreOutputs(outputs=[
        EngineCoreOutput(request_id=f"r{r}", new_token_ids=[5],
                         hook_outputs=[seal(chunks[f"r{r}"]) if sealed else chunks[f"r{r}"]])
        for r in range(64)])
    encoder, stop = MsgpackEncoder(), threading.Event()

    def busy():
        while not stop.is_set():
            sum(range(20000))  # ~1 ms of Python
            time.sleep(0.0002)

    loop = threading.Thread(target=busy)
    loop.start()
    try:
        frames = benchmark(lambda: encoder.encode_into(outputs, bytearray()))
    finally:
        stop.set()
        loop.join()
    assert len(frames) == (1 if sealed else 65)  # a frame per rows tensor, then the message


@pytest.mark.parametrize("at", ["prefill", "finish"])
def test_held_step(benchmark, at):
    """hold_outputs_bytes (courier/held_chunks.py), 64 qk requests: the worker's hold of
    their prefill step's chunks (kept: nothing sealed), and the step that finishes them
    all (their held chunks and HELD sealed together), per step."""
    import numpy as np

    from graphtap.courier.held import Ending, StepBatch
    from graphtap.courier.held_chunks import HeldChunks

    chunks = step_snapshot(64, LOADS["qk"][1], LOADS["qk"][0]).per_request()
    reqs = list(chunks)
    batch = StepBatch(reqs, np.full(len(reqs), 256))
    ending = Ending(frozenset(), cap=264, every_step=False)

    class Step:
        req_ids, sampled_token_ids = reqs, [[5]] * len(reqs)

    def held() -> HeldChunks:
        h = HeldChunks(1 << 40)
        for r in reqs:
            h.add_request(r, ending)
        return h

    if at == "prefill":
        benchmark.pedantic(lambda h: h.step(chunks, batch, Step),
                           setup=lambda: ((held(),), {}), rounds=50)
        return
    done = StepBatch(reqs, np.full(len(reqs), 263))

    def finishing():
        h = held()
        h.step(chunks, batch, Step)
        return (h,), {}

    def finish(h):
        return {r: seal(*sent) for r, sent in h.step({}, done, Step).items()}

    out = benchmark.pedantic(finish, setup=finishing, rounds=50)
    assert len(out) == 64 and all(p.frames for p in out.values())


@pytest.mark.parametrize("busy", [False, True], ids=["quiet", "busy"])
@pytest.mark.parametrize("reqs,rows_each,load", [(1, 1, "dump"), (8, 1, "dump"), (64, 1, "dump"),
                                                 (8, 256, "qk")],
                         ids=["hs-first1", "hs-step8", "decode64", "qk-prefill8"])
def test_split_and_seal_beside_a_busy_thread(benchmark, reqs, rows_each, load, busy):
    """The worker's output path of a step carrying one row per request at 3 sites (8 KiB
    each: a burst's first step, a prefill step of 8 requests' last-prompt rows, a decode
    step of 64 requests capturing every token): the split and the seal
    (StepSnapshots._per_request), as vLLM's async output thread runs it while the
    engine core's busy loop prepares the next step in Python. A torch call releases
    the GIL: beside a busy thread each one may wait. Steps of up to
    CaptureStep.direct_rows rows are sealed straight from the host copy
    (courier/direct.py); the chunk way made about 20 torch calls per request. From
    CaptureStep.uniform_rows rows a step of one spec (decode64) is cut in array passes,
    and past CaptureStep.direct_rows (qk-prefill8: k rows at 256 positions, q at the
    last, 4 layers) sealed from one copy per format, its k rows frames (views of it),
    where the chunk way made 434 torch calls."""
    from graphtap.courier import StepSnapshots

    stop = threading.Event()

    def loop():
        while not stop.is_set():
            sum(range(20000))  # ~1 ms of Python
            time.sleep(0.0002)

    thread = threading.Thread(target=loop)
    if busy:
        thread.start()
    try:
        out = benchmark.pedantic(
            lambda snap: snap._per_request(None), rounds=300,
            setup=lambda: ((StepSnapshots([step_snapshot(reqs, rows_each, load)]),), {}))
    finally:
        stop.set()
        if busy:
            thread.join()
    assert len(out) == reqs and all(bool(p.frames) == (load == "qk") for p in out.values())


@pytest.mark.parametrize("path", ["now", "later", "settle"])
@pytest.mark.parametrize("reqs,rows_each,load", [(8, 256, "qk"), (8, 1, "dump")],
                         ids=["qk-prefill8", "hs-step8"])
def test_what_a_steps_tokens_wait_for(benchmark, reqs, rows_each, load, path):
    """What vLLM's async output thread does with a step's hook outputs before the
    scheduler sees the step's tokens (StepSnapshots.per_request): `now`, the split and
    seal (before courier/later.py, and still for steps that may not wait); `later`, the
    deferred payloads that replace them for a step of DEFER_BYTES of rows or more; and
    `settle`, later plus every payload settled, the split the engine core's output thread
    then makes after the step's message has gone."""
    from graphtap.courier import StepSnapshots

    def run(snap):
        if path == "now":
            return snap._per_request(None)
        out = snap.per_request(None)
        return {r: p.settle() for r, p in out.items()} if path == "settle" else out

    out = benchmark.pedantic(run, rounds=100, setup=lambda: (
        (StepSnapshots([step_snapshot(reqs, rows_each, load)]),), {}))
    assert len(out) == reqs
    assert all(p.deferred for p in out.values()) == (path == "later")


def test_before_the_step_message_leaves_with_a_request_finishing(benchmark):
    """What the engine core's output thread does before it sends a qk prefill step's
    message (per_request on the worker, then split_hook_rows) when a decoding request
    of the batch, with capture entries but no rows in the step, finishes in it: as the
    burst's first requests do in its last prefill steps. Were that request part of the
    deferred split, split_hook_rows would settle its payload in place and the whole
    split would run before the message (H100 s37: the last 16 of 64 qk requests got
    their first token +4.4 to +5.4 ms after idle's); it is not, so nothing is split."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.worker.gpu.hooks import split_hook_rows

    from graphtap.courier import StepSnapshots

    def setup():
        snap = step_snapshot(8, 256, "qk")
        snap.slot_to_req = {**snap.slot_to_req, 8: "done"}  # count[1 + 8] == 0: no rows
        return (StepSnapshots([snap]),), {}

    def run(snaps):
        payloads = snaps.per_request(None)
        step = EngineCoreOutputs(outputs=[EngineCoreOutput(
            request_id="done", new_token_ids=[5], finish_reason=FinishReason.LENGTH,
            hook_outputs=[payloads["done"]] if "done" in payloads else None)] + [
            EngineCoreOutput(request_id=r, new_token_ids=[5], hook_outputs=[p])
            for r, p in payloads.items() if r != "done"])
        return split_hook_rows(step), payloads

    rows, payloads = benchmark.pedantic(run, rounds=100, setup=setup)
    assert len(rows.outputs) == 8 and "done" not in payloads


def test_deferred_split_of_a_mixed_qk_step(benchmark):
    """The split the engine core's output thread makes after a qk burst's usual step
    has left (DeferredSplit: split_now), 8 requests' prefills beside 56 decodes
    (mixed_qk_step): not uniform, so the chunk way, its groups 64 requests x 8 sites."""
    from graphtap.courier import StepSnapshots

    out = benchmark.pedantic(lambda snap: snap.split_now(), rounds=100,
                             setup=lambda: ((StepSnapshots([mixed_qk_step()]),), {}))
    assert len(out) == 64 and all(out[f"r{r}"].frames for r in range(56, 64))


def shipped_mixed_qk(shipped=None):
    """mixed_qk_step deferred and shipped whole (ShippedRows of the frontend, or a new
    one): the messages vLLM's output thread sends of it, decoded; with `shipped`, each
    request's payloads as the output processor keeps them, their step's split done on
    the split thread (as it is before a later step's finish)."""
    from graphtap.courier import StepSnapshots
    from graphtap.courier.later import Unsettled
    from test_courier_shipped import frontend_side, through_vllm

    later = StepSnapshots([mixed_qk_step()], unsettled=Unsettled(ship=True)).per_request(None)
    messages = through_vllm(later)
    if shipped is None:
        return messages
    kept = frontend_side(messages, shipped)
    for future in shipped._waiting["r56"].values():  # a prefill: every step's split
        future.result()
    return kept


def test_finish_of_shipped_qk_requests(benchmark):
    """The frontend's finish (finish_outputs' resolve, open and assemble, on AsyncLLM's
    output handler, where every token of the message waits for it) of the 8 requests
    whose prefills a shipped qk step carried (mixed_qk_step: k at 256 positions, q at
    the last, 1 MiB each), their step's split done on the split thread: as in a qk
    burst, where 8 requests finish in the message that brings 8 others' first tokens."""
    from graphtap.courier import assemble, open_chunks
    from graphtap.courier.shipped import ShippedRows

    done = [f"r{r}" for r in range(56, 64)]

    def setup():
        shipped = ShippedRows()
        return (shipped, shipped_mixed_qk(shipped)), {}

    def finish(shipped, kept):
        return [assemble([c for p in shipped.resolve(r, kept[r]) for c in open_chunks(p)])
                for r in done]

    outs = benchmark.pedantic(finish, setup=setup, rounds=60)
    assert all(o[f"blocks.{s}.attn.hook_k"].shape == (256, 4, 128) for o in outs
               for s in (1, 3, 5, 7))


@pytest.mark.parametrize("slices", ["finishes-last", "vllm-chunks"])
def test_tokens_beside_qk_finishes(benchmark, slices):
    """What a message's tokens wait for in AsyncLLM's own output handler
    (graphtap.testing.output_handler) when 8 qk requests finish in it, as a burst's first
    8 finish in the message that brings its last 8 their first token: their finishes
    assemble each one's shipped prefill rows (mixed_qk_step, 1 MiB a request), beside
    56 plain requests' tokens. Timed: the whole message; extra_info `tokens_ms`: until
    the last of the 56 tokens reached its consumer. finishes-last: graphtap's
    output_slices (patch 0008); vllm-chunks: vLLM's own slices, one of 64, as before."""
    import asyncio
    import statistics

    from vllm.v1.engine import FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
    from vllm.v1.worker.gpu.hooks import HookFrontend

    from graphtap.frontend import GraphtapFrontend
    from graphtap.spec import ModelShape
    from graphtap.testing.output_handler import start_output_handler
    from helpers import engine_request

    class Chunks(GraphtapFrontend):  # the control: vLLM's chunks, finishes in place
        output_slices = HookFrontend.output_slices

    shape = ModelShape(num_layers=8, hidden_size=4096, max_model_len=2048,
                       configured_sites={"blocks.1.attn.hook_k"}, max_steers=1,
                       max_vectors=2, max_captures=16, num_heads=32, num_kv_heads=8,
                       head_dim=128, save_root=None)
    spec = {"capture": [{"site": "blocks.1.attn.hook_k", "positions": "prompt"}]}
    done = [f"r{r}" for r in range(56, 64)]
    waited = []

    def setup():
        frontend = (GraphtapFrontend if slices == "finishes-last" else Chunks)(shape)
        proc = OutputProcessor(None, log_stats=False, hooks=frontend)
        queues = {}
        for r in range(64):
            request = engine_request(f"r{r}", max_tokens=1 if r >= 56 else 8)
            params = request.sampling_params
            params.hooks = spec if r >= 56 else None
            frontend.process_request(request.request_id, params, None, prompt_len=3)
            queues[request.request_id] = RequestOutputCollector(params.output_kind,
                                                                request.request_id)
            proc.add_request(request, None, queue=queues[request.request_id])
        kept = shipped_mixed_qk(frontend.shipped)
        message = EngineCoreOutputs(outputs=[
            EngineCoreOutput(request_id=r, new_token_ids=[5], hook_outputs=kept[r],
                             finish_reason=FinishReason.LENGTH) for r in done] + [
            EngineCoreOutput(request_id=f"r{r}", new_token_ids=[5]) for r in range(56)])
        return (proc, queues, message), {}

    def run(proc, queues, message):
        async def consume(rid):
            await queues[rid].get()
            return time.perf_counter()

        async def main():
            tokens = [asyncio.create_task(consume(f"r{r}")) for r in range(56)]
            finishes = [asyncio.create_task(queues[r].get()) for r in done]
            await asyncio.sleep(0)
            t0 = time.perf_counter()
            llm = start_output_handler(proc, [message])
            got = await asyncio.gather(*tokens)
            outs = await asyncio.gather(*finishes)
            llm.output_handler.cancel()
            waited.append((max(got) - t0) * 1e3)
            return outs

        return asyncio.run(main())

    outs = benchmark.pedantic(run, setup=setup, rounds=40)
    benchmark.extra_info["tokens_ms"] = round(statistics.median(waited), 3)
    assert all(o.hooks.error is None and o.hooks["blocks.1.attn.hook_k"].shape ==
               (256, 4, 128) for o in outs)


def test_split_of_a_shipped_qk_step(benchmark):
    """The frontend's split thread's work on a qk burst's usual step shipped whole
    (mixed_qk_step: 8 prefills beside 56 decodes): the step split per request, each
    request's payload opened and its values kept in storage of its own or of its own
    pack (courier/shipped.py: _made). The thread holds the GIL between torch calls,
    beside the output handler and the admission of the burst's later requests."""
    from graphtap.courier.shipped import _BUNDLE, BUNDLE, _is_bundle, _made
    from graphtap.profiling import HostClock

    rows = shipped_mixed_qk()[1]
    carried = next(p for o in rows.outputs for p in o.hook_outputs if _is_bundle(p))
    meta = _BUNDLE.decode(memoryview(carried.inline)[len(BUNDLE):])
    out = benchmark.pedantic(_made, args=(meta, carried.frames, HostClock()), rounds=40,
                             warmup_rounds=3)
    assert len(out) == 64 and all(out[f"r{r}"].frames for r in range(64))
