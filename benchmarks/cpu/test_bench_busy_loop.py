"""What the engine core's busy loop loses while vLLM's output thread splits a capture
step's rows beside it (issue 18). On the H100 (session 39) a burst's first steps are
host-bound: the device was busy 32-35 ms of the first 60, with gaps between launches.
Under vLLM's torch profiler, a qk burst's steps from the second on took 20-29 ms
against idle's 16-19, running the same vLLM ops, each one slower. That was the busy
loop waiting for the GIL while the output thread split the previous step's qk rows
(33-45 ms of splits a burst). What the split costs the loop, not its own wall time, is
what this measures. The busy loop here stands in for vLLM's: a small torch call (the
GIL released and taken back, as every launch does) and some Python, a fixed amount of
work; beside it, one step's split (StepSnapshots._per_request). The loop's extra time
over `nothing` is what one split costs every request of the batch.

The qk steps are a burst's usual ones under chunked prefill: 9 decoding requests with
no rows beside 7 whole prefills, the first 217 prompt tokens of one request and the
last 39 of another (k at every prompt position, q at the last, 4 layers x 4 heads), so
not uniform (the chunk way); and, for comparison, 8 whole prefills (uniform: the
direct seal). test_busy_loop_beside_a_rows_message puts the output thread's whole part
of a chunked step beside it: split and encoded, or shipped whole to be split in the
frontend (courier/shipped.py) and encoded."""
import threading

import pytest
import torch

from graphtap.courier import CaptureStep, OverflowKind, RowFormat, StepRows

LOOP = 2000  # iterations: ~10 ms here, longer than any split beside it


def chunked_qk_step(decodes: int = 9, whole: int = 7, head: int = 217, tail: int = 39,
                    prompt: int = 256) -> CaptureStep:
    """A qk burst's step under chunked prefill, rows site-major as the device writes
    them (head=tail=0: `whole` prefills only, every request asking the same)."""
    q = RowFormat(torch.bfloat16, 4096, (0, 1, 2, 3), 128)
    k = RowFormat(torch.bfloat16, 1024, (0, 1, 2, 3), 128)
    spans = [[]] * decodes + [list(range(prompt))] * whole
    spans += [list(range(head))] if head else []
    spans += [list(range(prompt - tail, prompt))] if tail else []
    labels = []
    for site in range(8):
        for slot, positions in enumerate(spans):
            if site % 2:  # k: every prompt position of the step
                labels += [(slot, site, p) for p in positions]
            elif positions and positions[-1] == prompt - 1:  # q: the last prompt token
                labels.append((slot, site, prompt - 1))
    n, at = len(labels), torch.tensor(labels)
    layout = {s: k if s % 2 else q for s in range(8)}
    return CaptureStep(StepRows(
        torch.randn(n, 512).to(torch.bfloat16), at,
        torch.cat([torch.tensor([n]), torch.bincount(at[:, 0], minlength=len(spans) + 1)]),
        {r: f"r{r}" for r in range(len(spans))}, dict.fromkeys(range(len(spans)), layout),
        {s: f"blocks.{s}.attn.hook_{'qk'[s % 2]}" for s in range(8)}, 1 << 20,
        OverflowKind.CAPTURE_ROWS))


def busy_loop(x: torch.Tensor) -> None:
    for _ in range(LOOP):
        x.add_(1)  # a torch call: the GIL released and taken back
        sum(range(40))  # a few microseconds of Python


def sent(step: CaptureStep, ship: bool) -> list:
    """What the engine core's output thread does with a deferred step: each request's
    payload settled (split here) or shipped (the step whole, courier/shipped.py), and
    the rows' message encoded by vLLM's encoder."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackEncoder

    from graphtap.courier import StepSnapshots
    from graphtap.courier.later import Unsettled

    later = StepSnapshots([step], unsettled=Unsettled(ship=ship)).per_request(None)
    outputs = [EngineCoreOutput(request_id=r, new_token_ids=[], hooks_only=True,
                                hook_outputs=[p.ship()]) for r, p in later.items()]
    return MsgpackEncoder().encode(EngineCoreOutputs(outputs=outputs))


def loop_beside(benchmark, work) -> list:
    """Times busy_loop while another thread runs the job `work()` makes for each round
    (None: nothing beside it); the last round's results."""
    def setup():
        job = work()
        go, done = threading.Event(), []

        def run_job():
            go.wait()
            if job is not None:
                done.append(job())

        thread = threading.Thread(target=run_job)
        thread.start()
        return (go, thread, done), {}

    x = torch.zeros(64)

    def run(go, thread, done):
        go.set()
        busy_loop(x)
        thread.join()  # done well before the loop (its splits take ~1.5 ms)
        return done

    return benchmark.pedantic(run, setup=setup, rounds=60)


@pytest.mark.parametrize("ship", [False, True], ids=["split-sent", "shipped"])
def test_busy_loop_beside_a_rows_message(benchmark, ship):
    """The output thread's whole part of a chunked qk step: split and encoded, or
    shipped whole (split in the frontend's process) and encoded."""
    def work():
        step = chunked_qk_step()
        return lambda: sent(step, ship)

    assert loop_beside(benchmark, work)


@pytest.mark.parametrize("beside", ["nothing", "qk-chunked", "qk-uniform8"])
def test_busy_loop_beside_a_split(benchmark, beside):
    from graphtap.courier import StepSnapshots

    def work():
        if beside == "nothing":
            return None
        step = chunked_qk_step() if beside == "qk-chunked" else \
            chunked_qk_step(whole=8, head=0, tail=0)
        return lambda: StepSnapshots([step])._per_request(None)

    done = loop_beside(benchmark, work)
    assert (len(done[0]) if done else 0) == {"nothing": 0, "qk-chunked": 9,
                                             "qk-uniform8": 8}[beside]
