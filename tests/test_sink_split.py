"""The courier's half of the bulk sink (CaptureStep._to_sink), without an engine: a
step's sink rows leave in one hand-over, a run per site and format, found from the labels with array
operations (a decode step of 64 requests x 32 sites is 2048 one-row groups, and handing
them over one by one cost 47 ms a step on the H200 host, profile_capture sink mode);
the rows, labels and token ids equal the buffer's; rows in the buffer's format go as
views of the step copy; other requests of the step still come back per request; a
request that lost rows sends none."""
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphtap.courier import CaptureStep, RowFormat, StepRows
from graphtap.courier.chunks import OVERFLOW, Overflow, OverflowKind
from graphtap.courier.pack import unpack
from graphtap.courier.rows import NO_SINK
from graphtap.engine.families.capture import CaptureFamily, SinkTap
from graphtap.engine.rows import RowFamily
from helpers import RecordingSink

WIDTH = 8
BF16 = RowFormat(torch.bfloat16, WIDTH, None, 0)
F32 = RowFormat(torch.float32, WIDTH, None, 0)


def capture_step(labels, wanted, slot_to_req, formats, sink_of, request_of, live,
                 whole: bool = False):
    """A capture step as the capture family hands it over: bf16 rows, labels (slot,
    site, position), per slot the units it wanted, a token id per row, and the tap
    (`whole`: with the family's flags of requests whose every entry sinks)."""
    labels = torch.tensor(labels)
    rows = torch.randn(len(labels), WIDTH).to(torch.bfloat16)
    count = torch.tensor([len(labels), *wanted])
    step = CaptureStep(StepRows(rows, labels, count, slot_to_req, formats,
                                {0: "s0", 1: "s1", 2: "s2", 3: "s3"}, 1000,
                                OverflowKind.CAPTURE_ROWS))
    writer = RecordingSink()
    fmts = (BF16, F32)
    format_of = np.full((max(slot_to_req) + 2, 4), NO_SINK, np.int32)
    for (slot, site), fmt in sink_of.items():
        format_of[slot, site] = fmts.index(fmt)
    flags = np.zeros(len(format_of), bool)
    for slot, sites in formats.items():
        flags[slot] = all((slot, site) in sink_of for site in sites)
    step.sink = SinkTap(writer, format_of, np.asarray(request_of, np.int64), fmts, live,
                        whole=flags if whole else None)
    step.tokens = torch.arange(len(labels), dtype=torch.int64) + 1000
    return step, writer


def test_sink_rows_leave_per_site_and_format_beside_per_request_rows():
    # slots: a (0) sinks s0 in bf16 and s1 in float32, returns s2; b (1) sinks s0 and
    # returns s1; c (2) sinks s0 but lost a row (wanted 2, 1 labelled); d (3) no sink.
    # s0's rows come in batch order a, d, b, c: two runs of sink rows.
    labels = ([(0, 0, p) for p in (5, 6, 7)] + [(3, 0, 9), (1, 0, 4), (2, 0, 2)] +
              [(0, 1, p) for p in (5, 6, 7)] + [(1, 1, 4)] + [(0, 2, p) for p in (5, 6, 7)])
    formats = {0: {0: BF16, 1: F32, 2: BF16}, 1: {0: BF16, 1: F32}, 2: {0: BF16},
               3: {0: BF16}}
    sink_of = {(0, 0): BF16, (0, 1): F32, (1, 0): BF16, (2, 0): BF16}
    live = {0, 1, 2}
    step, writer = capture_step(labels, [9, 2, 2, 1], {0: "a", 1: "b", 2: "c", 3: "d"},
                                formats, sink_of, [70, 71, 72, 0], live)
    out = {r: unpack(c) for r, c in step.per_request().items()}
    assert writer.handovers == 1  # one hand-over a step
    assert [p[0] for p in writer.puts] == ["s0", "s1"]  # a run per site and format
    site, request, position, values, token = writer.puts[0]
    assert request.tolist() == [70, 70, 70, 71] and position.tolist() == [5, 6, 7, 4]
    assert token.tolist() == [1000, 1001, 1002, 1004]
    assert len(values) == 2  # the two runs, views of the step copy
    for v in values:
        assert v.untyped_storage().data_ptr() == step.rows.untyped_storage().data_ptr()
    assert torch.equal(torch.cat(values), step.rows[[0, 1, 2, 4]])
    site, request, position, values, token = writer.puts[1]
    assert request.tolist() == [70] * 3 and position.tolist() == [5, 6, 7]
    assert torch.equal(torch.cat(values), step.rows[6:9].float())  # cast on the way
    assert token.tolist() == [1006, 1007, 1008]
    # per request: what is not sunk, and c's overflow instead of anything
    assert set(out) == {"a", "b", "c", "d"}
    assert set(out["a"]) == {"s2", "s2@positions"}
    assert torch.equal(out["a"]["s2"], step.rows[10:13])
    assert torch.equal(out["b"]["s1"], step.rows[9:10].float())
    assert out["d"]["s0@positions"].tolist() == [9]
    assert set(out["c"]) == {OVERFLOW} and Overflow.from_tensor(out["c"][OVERFLOW]).wanted == 2
    assert writer.flushes == 0
    live.clear()  # the last sink request left before its rows came home: shards go out
    step, writer = capture_step([(0, 0, 1)], [1], {0: "a"}, {0: {0: BF16}},
                                {(0, 0): BF16}, [70], live)
    assert step.per_request() == {} and writer.flushes == 1


def test_a_decode_step_of_many_requests_is_one_handover_of_a_run_per_site():
    """64 requests x 4 sites, one row each, site-major as the device writes them: one
    hand-over of 4 runs, each one view of the step copy (the writer used to get 64
    one-row pieces a site and write each with a call of its own, then one put a site)."""
    n, sites = 64, 4
    labels = [(r, s, 100 + r) for s in range(sites) for r in range(n)]
    formats = {r: {s: BF16 for s in range(sites)} for r in range(n)}
    sink_of = {(r, s): BF16 for r in range(n) for s in range(sites)}
    step, writer = capture_step(labels, [sites] * n, {r: f"r{r}" for r in range(n)},
                                formats, sink_of, np.arange(n) + 7, set(range(n)))
    assert step.per_request() == {}
    assert writer.handovers == 1 and [p[0] for p in writer.puts] == ["s0", "s1", "s2", "s3"]
    for s, (_, request, position, values, _) in enumerate(writer.puts):
        assert len(values) == 1 and torch.equal(values[0], step.rows[s * n:(s + 1) * n])
        assert request.tolist() == list(range(7, 7 + n))
        assert position.tolist() == list(range(100, 100 + n))


def test_the_capture_family_narrows_the_columns_a_step_copies():
    """CaptureFamily.columns (the widest format of the step's requests) had slipped into
    SinkTap's body when the sink was wired in, so every capture step cloned and copied
    home whole rows again (a qk prefill step: 6x the bytes)."""
    assert CaptureFamily.columns is not RowFamily.columns
    family = object.__new__(CaptureFamily)
    family._cols = {0: 256, 1: 512, 2: 1536}
    assert family.columns([0, 1], batch=None) == 512
    assert family.columns([], batch=None) == 0


class Event:
    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def test_the_copy_event_goes_with_views_and_is_waited_for_before_copies_here():
    """On a GPU a sink step's rows come home on the sink's stream, `rows_ready` its
    event: views of them go to the writer with the event (the engine's thread does not
    wait); the engine's thread waits only where it reads the rows itself: a cast or head
    cut for the sink, or another request's rows in the same step."""
    sink_all = {(0, 0): BF16, (0, 1): BF16}
    formats = {0: {0: BF16, 1: BF16}, 1: {0: BF16}}
    labels = [(0, 0, 1), (1, 0, 1), (0, 1, 1)]
    step, writer = capture_step(labels[::2], [2], {0: "a"}, formats, sink_all, [5], {0})
    step.rows_ready = ready = Event()
    assert step.per_request() == {} and writer.ready is ready and ready.waited == 0
    step, writer = capture_step(labels, [2, 1], {0: "a", 1: "b"}, formats, sink_all,
                                [5, 6], {0})  # b's row comes back with b
    step.rows_ready = ready = Event()
    assert set(step.per_request()) == {"b"} and writer.ready is ready and ready.waited == 1
    step, writer = capture_step(labels[::2], [2], {0: "a"}, {0: {0: F32, 1: BF16}},
                                {(0, 0): F32, (0, 1): BF16}, [5], {0})  # a cast: a copy
    step.rows_ready = ready = Event()
    assert step.per_request() == {} and writer.ready is None and ready.waited == 1


class FailedSink(RecordingSink):
    def put_runs(self, *args, **kwargs):
        from graphtap.courier.sink import SinkFailed
        raise SinkFailed("sink: the writer stopped: OSError(28, 'No space left on device')")


def test_a_stopped_writer_fails_the_sink_requests_of_the_step_not_the_engine():
    """A full disk stops the writer and every later put raises SinkFailed: it went up
    through the courier into vLLM's output path and killed the engine. Now each request
    with sink rows in the step gets the error; other requests' rows still come back."""
    from graphtap.courier.chunks import ERROR, error_message

    labels = [(0, 0, 5), (1, 0, 4), (2, 0, 3)]
    step, _ = capture_step(labels, [1, 1, 1], {0: "a", 1: "b", 2: "c"},
                           {0: {0: BF16}, 1: {0: BF16}, 2: {0: BF16}},
                           {(0, 0): BF16, (2, 0): BF16}, [70, 71, 72], {0, 2})
    step.sink.writer = FailedSink()
    out = {r: unpack(c) for r, c in step.per_request().items()}
    assert set(out) == {"a", "b", "c"}
    for req in "ac":
        assert "No space left" in error_message(out[req][ERROR]) and len(out[req]) == 1
    assert torch.equal(out["b"]["s0"], step.rows[1:2])


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_whole_sink_step_hands_over_what_the_row_by_row_path_does(data):
    """A harvest's step (every entry of every request sinks, one format a site that is a
    view of the step copy) finds its runs from the site labels alone, and both paths
    leave the per-row labels to the writer's thread (SlotRequests): 131072 rows a step
    of Llama-3-8B's every layer, where the row-by-row path held up the next step. Whatever
    the step, both paths hand the writer the same runs, rows, requests, positions and
    tokens; steps the fast path cannot take (a cast, a site in two formats, a request
    returning rows) go row by row."""
    n_req = data.draw(st.integers(1, 5))
    sites = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True))
    formats, sink_of = {}, {}
    for r in range(n_req):
        mine = data.draw(st.lists(st.sampled_from(sites), min_size=1, unique=True))
        formats[r] = {}
        for site in mine:
            fmt = data.draw(st.sampled_from([BF16, BF16, F32]))
            formats[r][site] = fmt
            if data.draw(st.integers(0, 9)):  # mostly sink entries
                sink_of[(r, site)] = fmt
    labels, wanted = [], [0] * n_req
    for site in sorted(sites):  # site-major, requests in any order within a site
        for r in data.draw(st.permutations(range(n_req))):
            if site in formats[r]:
                for p in range(data.draw(st.integers(0, 3))):
                    labels.append((r, site, 10 * r + p))
                    wanted[r] += 1
    if not labels:
        return
    slot_to_req = {r: f"r{r}" for r in range(n_req)}
    live = {r for r, _ in sink_of}
    request_of = np.arange(n_req) + 40
    got = {}
    for whole in (False, True):
        step, writer = capture_step(labels, wanted, slot_to_req, formats, sink_of,
                                    request_of, live, whole=whole)
        torch.manual_seed(0)
        step.rows = torch.randn(len(labels), WIDTH).to(torch.bfloat16)
        taken = step._whole_runs(np.array(labels)[:, 1], len(labels)) is not None
        out = {r: unpack(c) for r, c in step.per_request().items()}
        got[whole] = (out, writer.puts, taken)
    (out0, puts0, _), (out1, puts1, taken) = got[False], got[True]
    fast = (all(sink_of.get((r, s)) == BF16 for r in formats for s in formats[r])
            and all(len({formats[r][s] for r in formats if s in formats[r]}) <= 1
                    for s in sites))
    assert taken == fast
    assert out0.keys() == out1.keys()
    for req in out0:
        assert out0[req].keys() == out1[req].keys()
        assert all(torch.equal(out0[req][k], out1[req][k]) for k in out0[req])
    assert len(puts0) == len(puts1)
    for a, b in zip(puts0, puts1):
        assert a[0] == b[0] and a[1].tolist() == b[1].tolist()
        assert a[2].tolist() == b[2].tolist() and a[4].tolist() == b[4].tolist()
        assert torch.equal(torch.cat(a[3]), torch.cat(b[3]))
