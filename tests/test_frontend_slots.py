"""The hook frontend is per engine (patch 0004): two engines in one process, one hooked and
one not, each admit, release and finish their own requests with their own frontend; the
chunks reach it as the steps sent them (patch 0005)."""
import torch

from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.outputs import HookPayload
from vllm.v1.worker.gpu.hooks import HookFrontend

from helpers import engine_request


class Recorder(HookFrontend):
    def __init__(self):
        self.calls = []

    def admit_request(self, request):
        self.calls.append(("admit", request.request_id))

    def release_request(self, request_id):
        self.calls.append(("release", request_id))

    def finish_outputs(self, request_id, chunks, num_tokens):
        self.calls.append(("finish", request_id, num_tokens))
        return {"rows": torch.cat([c.frames["rows"] for c in chunks])}


def run(proc: OutputProcessor, rid: str):
    proc.add_request(engine_request(rid), None)
    chunk = lambda v: HookPayload(frames={"rows": torch.full((1, 2), v)})  # noqa: E731
    proc.process_outputs([EngineCoreOutput(request_id=rid, new_token_ids=[7],
                                           hook_outputs=[chunk(1.0)])])
    done = proc.process_outputs([EngineCoreOutput(
        request_id=rid, new_token_ids=[8], finish_reason=FinishReason.LENGTH,
        hook_outputs=[chunk(2.0), chunk(3.0)])])
    return done.request_outputs[0]


def test_each_engine_finishes_its_requests_with_its_own_frontend():
    hooked = Recorder()
    a = OutputProcessor(None, log_stats=False, hooks=hooked)
    b = OutputProcessor(None, log_stats=False)  # an engine without a hook manager
    out_b = run(b, "plain")  # created after the hooked one: once took over its frontend
    out_a = run(a, "hooked")
    # the finish gets the request's length: 3 prompt tokens and 2 generated
    assert hooked.calls == [("admit", "hooked"), ("finish", "hooked", 5), ("release", "hooked")]
    assert torch.equal(out_a.hooks["rows"], torch.tensor([[1.0] * 2, [2.0] * 2, [3.0] * 2]))
    # the plain engine's no-op frontend returns the chunks as they came (nothing asked
    # for them: an engine without a hook manager never gets any)
    assert [c.frames["rows"][0, 0].item() for c in out_b.hooks] == [1.0, 2.0, 3.0]
    # and a request that sent none gets None from it, as stock vLLM gives
    b.add_request(engine_request("bare"), None)
    bare = b.process_outputs([EngineCoreOutput(request_id="bare", new_token_ids=[7, 8],
                                               finish_reason=FinishReason.LENGTH)])
    assert bare.request_outputs[0].hooks is None
    # an abort goes to the request's own engine's frontend too
    a.add_request(engine_request("gone"), None)
    a.abort_requests(["gone"], internal=True)
    assert hooked.calls[-2:] == [("admit", "gone"), ("release", "gone")]


def _shape():
    from graphtap.spec import ModelShape

    return ModelShape(num_layers=2, hidden_size=8, max_model_len=64,
                      configured_sites={"blocks.1.hook_resid_post"}, max_steers=1,
                      max_vectors=2, max_captures=2, num_heads=2, num_kv_heads=2,
                      save_root=None)


def test_a_messages_other_tokens_reach_their_consumers_before_a_capturing_finish():
    """AsyncLLM's own output handler (patch 0008: HookFrontend.output_slices), fed one
    message by a stand-in engine core: a capturing request finishes in it (its finish
    assembles its hook outputs on the handler) beside a plain request's token, as the
    first requests of a burst finish in the message that brings the last ones their
    first token. The plain request's consumer has its token before that finish runs;
    the capturing one still gets its outputs, whole."""
    import asyncio

    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.engine.output_processor import RequestOutputCollector

    from graphtap.courier.payload import seal
    from graphtap.frontend import GraphtapFrontend
    from graphtap.testing.output_handler import start_output_handler

    site = "blocks.1.hook_resid_post"
    events = []

    class Frontend(GraphtapFrontend):
        def finish_outputs(self, request_id, chunks, num_tokens=0):
            events.append(("finish", request_id))
            return super().finish_outputs(request_id, chunks, num_tokens)

    frontend = Frontend(_shape())
    proc = OutputProcessor(None, log_stats=False, hooks=frontend)
    queues = {}
    for rid, hooks in (("captures", {"capture": [{"site": site}]}), ("plain", None),
                       ("goes-on", None)):
        request = engine_request(rid, max_tokens=1 if rid != "goes-on" else 4)
        params = request.sampling_params
        params.hooks = hooks
        request.cache_salt = frontend.process_request(rid, params, None, prompt_len=3)
        queues[rid] = RequestOutputCollector(params.output_kind, rid)
        proc.add_request(request, None, queue=queues[rid])
    rows = seal({site: torch.ones(3, 8), f"{site}@positions": torch.arange(3)})
    message = EngineCoreOutputs(outputs=[  # the scheduler's order: the finish first
        EngineCoreOutput(request_id="captures", new_token_ids=[7], hook_outputs=[rows],
                         finish_reason=FinishReason.LENGTH),
        EngineCoreOutput(request_id="plain", new_token_ids=[8],
                         finish_reason=FinishReason.LENGTH),
        EngineCoreOutput(request_id="goes-on", new_token_ids=[9])])

    async def consume(rid):
        out = await queues[rid].get()
        events.append(("token", rid))
        return out

    async def main():
        consumers = [asyncio.create_task(consume(r)) for r in queues]
        await asyncio.sleep(0)  # each consumer waits on its queue
        llm = start_output_handler(proc, [message])
        try:
            return await asyncio.wait_for(asyncio.gather(*consumers), 10)
        finally:
            llm.output_handler.cancel()

    # the slices: the capturing finish last, on its own; without one, vLLM's own
    assert frontend.output_slices(message.outputs, 2) == \
        [message.outputs[1:], message.outputs[:1]]
    assert frontend.output_slices(message.outputs[1:], 2) == [message.outputs[1:]]
    assert frontend.output_slices(message.outputs[:1], 2) == [message.outputs[:1]]
    outs = asyncio.run(main())
    assert events.index(("token", "plain")) < events.index(("finish", "captures"))
    assert events.index(("token", "goes-on")) < events.index(("finish", "captures"))
    captured = outs[0].hooks
    assert captured.error is None and torch.equal(captured[site], torch.ones(3, 8))
    assert [o.outputs[0].token_ids for o in outs] == [[7], [8], [9]]
