"""CPU benchmark of the deliver phase of a capturing request's first token: one step's
per-request chunks (CaptureStep.per_request, as the worker makes them) carried by
vLLM's EngineCoreOutputs through its own msgpack encoder and decoder, the path from the
engine core to the frontend (the ZMQ hop itself left out; frames are copied once, as
a receive would). Issue 18: on the H200, requests capturing with their prefill step
reach their first token later than idle ones, deliver +6 ms for 64 hs requests and +18
ms for 64 qk ones (benchmarks/results/README.md, `llama3-8b-ttft`); this is the part of
it that a change to the chunks' layout moves, measured per step here."""
import pytest
import torch
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from graphtap.courier import CaptureStep, OverflowKind, RowFormat, StepRows

WIDTH, HEADS, HEAD_DIM = 4096, (0, 1, 2, 3), 128
HS = RowFormat(torch.bfloat16, WIDTH, None, 0)
QK = RowFormat(torch.bfloat16, WIDTH, HEADS, HEAD_DIM)


def capture_chunks(load: str, reqs: int, prompt: int = 256) -> dict:
    """A prefill step's chunks. hs: resid_post at 3 layers, the last prompt token (8 KiB
    rows); qk: q at the last prompt token and k at every prompt token, 4 layers x 4 heads
    (rows narrowed to the 512 columns the heads use, as the capture family clones them)."""
    if load == "hs":
        sites = {s: (f"blocks.{8 * (s + 1)}.hook_resid_post", HS, [prompt - 1]) for s in range(3)}
    else:
        sites = {s: (f"blocks.{4 * (s // 2 + 1)}.attn.hook_{'qk'[s % 2]}", QK,
                     [prompt - 1] if s % 2 == 0 else list(range(prompt))) for s in range(8)}
    labels = torch.tensor([(r, s, p) for s, (_, _, pos) in sites.items() for r in range(reqs)
                           for p in pos])
    count = torch.cat([torch.tensor([len(labels)]), torch.bincount(labels[:, 0], minlength=reqs)])
    cols = WIDTH if load == "hs" else len(HEADS) * HEAD_DIM
    step = CaptureStep(StepRows(torch.randn(len(labels), cols).to(torch.bfloat16), labels, count,
                                {r: f"r{r}" for r in range(reqs)},
                                {r: {s: f for s, (_, f, _) in sites.items()} for r in range(reqs)},
                                {s: name for s, (name, _, _) in sites.items()}, 1 << 22,
                                OverflowKind.CAPTURE_ROWS))
    return step.per_request()


def deliver(encoder, decoder, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
    frames = encoder.encode(outputs)
    return decoder.decode([bytes(f) for f in frames])


@pytest.mark.parametrize("load,reqs", [("idle", 64), ("hs", 16), ("hs", 64), ("qk", 16)],
                         ids=["idle64", "hs16", "hs64", "qk16"])
def test_deliver_step(benchmark, load, reqs):
    chunks = {} if load == "idle" else capture_chunks(load, reqs)
    outputs = EngineCoreOutputs(outputs=[
        EngineCoreOutput(request_id=f"r{r}", new_token_ids=[5],
                         hook_outputs=[chunks[f"r{r}"]] if chunks else None)
        for r in range(reqs)])
    back = benchmark(deliver, MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs), outputs)
    assert len(back.outputs) == reqs
    if chunks:
        sent, got = chunks["r0"], back.outputs[0].hook_outputs[0]
        assert sent.keys() == got.keys() and all(torch.equal(sent[k], got[k]) for k in sent)
