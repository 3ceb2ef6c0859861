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
