"""The sink's staging memory (courier/staging.py, SinkWriter.stage/settle), without an
engine or a GPU (unpinned here; on a GPU it is pinned with cudaHostRegister): a step
copy takes a block, hands views of it to the writer, and the block is free again once
every byte handed over is written, whatever the order of settle and writes; freed
holes coalesce; a full staging makes the step wait while the writer will free a block
(writing shards early) and falls back to torch's allocator where waiting could not end;
the capture step settles its block with the bytes it handed over."""
import numpy as np
import pytest
import torch

from graphtap.courier import CaptureStep, OverflowKind, RowFormat, StepRows
from graphtap.courier.pack import unpack
from graphtap.courier.sink import SinkWriter
from graphtap.courier.staging import ALIGN, Staging
from graphtap.engine.families.capture import SinkTap

PAGE = ALIGN


def test_blocks_are_freed_when_settled_and_written_in_any_order():
    st = Staging(8 * PAGE)
    a, b, c = st.take(PAGE), st.take(2 * PAGE + 1), st.take(PAGE)
    assert (a, b, c) == (0, PAGE, 4 * PAGE)  # b rounded up to 3 pages
    assert st.take(4 * PAGE) is None and not st.freeable()
    assert not st.release(st.base + b + 16, 100)  # written before the step settles
    assert not st.settle(b, 300) and st.freeable()
    assert st.release(st.base + b + 200, 200)  # all 300 handed bytes written: free
    assert not st.release(st.base + 100 * PAGE, 8)  # not staging memory
    with pytest.raises(RuntimeError, match="outside a live block"):
        st.release(st.base + 7 * PAGE, 8)  # a hole: the accounting would be wrong
    assert st.settle(a, 0)  # nothing handed over: free at once
    assert st.take(4 * PAGE) == 0  # a and b coalesced into one hole of 4 pages
    st.settle(0, 0)
    st.settle(c, 0)
    assert st.idle() and st.take(8 * PAGE) == 0


def test_a_block_views_any_dtype():
    st = Staging(4 * PAGE)
    like = torch.randn(5, 3).to(torch.bfloat16)
    offset = st.take(like.numel() * 2)
    view = st.view(offset, like)
    view.copy_(like)
    assert view.dtype == torch.bfloat16 and torch.equal(view, like)
    assert view.untyped_storage().data_ptr() == st.buf.untyped_storage().data_ptr()


def staged_rows(sink: SinkWriter, n: int, width: int = 256):
    rows = torch.randn(n, width)
    offset, host = sink.stage(rows)
    host.copy_(rows)
    return offset, host


def test_staged_views_are_written_then_their_block_is_free(tmp_path):
    sink = SinkWriter(tmp_path, shard_rows=3, staging=Staging(64 * PAGE))
    offset, host = staged_rows(sink, 8)
    sink.put_runs(np.zeros(8), np.arange(8), np.zeros(8), [("a", 5, [host[:5]]),
                                                         ("b", 3, [host[5:]])])
    sink.settle(offset, host.numel() * 4)
    index = sink.sync()
    assert [s["rows"] for s in index["shards"] if s["site"] == "a"] == [3, 2]
    assert sink.staging.idle()
    sink.close()


def pages(k: int) -> torch.Tensor:
    return torch.zeros(k * PAGE // 16, 4)  # k pages of float32


def test_a_full_staging_waits_for_the_writer_and_falls_back_when_it_cannot(tmp_path):
    sink = SinkWriter(tmp_path, shard_rows=1 << 20, staging=Staging(16 * PAGE))
    assert sink.stage(pages(9)) is None  # over half of it: torch's allocator
    first, host = sink.stage(pages(7))
    second, _ = sink.stage(pages(7))
    # both blocks unsettled (steps not yet handed over): waiting could never end
    assert sink.stage(pages(4)) is None and sink.waits == 0
    n = len(host)
    sink.put_runs(np.zeros(n), np.arange(n), np.zeros(n), [("a", n, [host])])
    sink.settle(first, 7 * PAGE)
    # the first block is freeable but sits in an open shard (1 << 20 rows): the waiting
    # step makes the writer write it early, then gets its room
    third, _ = sink.stage(pages(4))
    assert third == 0 and sink.waits == 1
    sink.settle(second, 0)
    sink.settle(third, 0)
    assert sink.sync()["shards"][0]["rows"] == n and sink.staging.idle()
    stats = sink.stats()
    assert (stats["staged_total"], stats["unstaged_total"]) == (3, 2)
    sink.close()


def test_the_capture_step_settles_its_block_with_the_bytes_it_handed_over(tmp_path):
    """A step whose rows were staged: views of them go to the writer, the cast rows are
    copies, a request's own rows come back; the block is free once the writer wrote the
    views (CaptureStep._rows_home stages on a GPU; set by hand here)."""
    from graphtap.courier.rows import NO_SINK

    f32, bf16 = RowFormat(torch.float32, 8, None, 0), RowFormat(torch.bfloat16, 8, None, 0)
    sink = SinkWriter(tmp_path, staging=Staging(16 * PAGE))
    labels = torch.tensor([(0, 0, 1), (1, 0, 1), (2, 0, 1), (0, 1, 1)])
    rows = torch.randn(4, 8)
    offset, host = sink.stage(rows)
    host.copy_(rows)
    step = CaptureStep(StepRows(host, labels, torch.tensor([4, 2, 1, 1]),
                                {0: "a", 1: "b", 2: "c"},
                                {0: {0: f32, 1: bf16}, 1: {0: f32}, 2: {0: f32}},
                                {0: "s0", 1: "s1"}, 100, OverflowKind.CAPTURE_ROWS))
    format_of = np.full((3, 2), NO_SINK, np.int32)
    format_of[0] = [0, 1]  # a sinks s0 as is (a view) and s1 as bf16 (a copy)
    format_of[2, 0] = 0  # c sinks s0; b's row comes back with b
    step.sink = SinkTap(sink, format_of, np.arange(3), (f32, bf16), {0, 2})
    step.tokens = torch.arange(4)
    step.staged = offset
    out = {r: unpack(c) for r, c in step.per_request().items()}
    assert set(out) == {"b"} and torch.equal(out["b"]["s0"], rows[1:2])
    assert step.staged is None  # settled: 2 rows of 8 float32 handed over as views
    sink.sync()
    assert sink.staging.idle()
    sink.close()


def test_staging_smaller_than_a_page_is_refused():
    with pytest.raises(ValueError, match="less than a page"):
        Staging(100)
