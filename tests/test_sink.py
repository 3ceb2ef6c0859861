"""The bulk sink's writer (courier/sink.py), without an engine: every row put comes out
once, in order, per site, across shards; memory stays under its bound while a slow disk
holds the writer back (put blocks, nothing is dropped); a failed write stops the sink
loudly; the index lists requests and shards."""
import json
import threading
import time

import numpy as np
import pytest
from graphtap.courier.sink import SinkFailed, SinkWriter
from safetensors.numpy import load_file

WIDTHS = {"blocks.0.hook_resid_post": 8, "blocks.1.attn.hook_q": 12, "blocks.2.hook_resid_mid": 8}


def read_site(root, index, site):
    parts = [load_file(str(root / s["file"])) for s in index["shards"] if s["site"] == site]
    return {k: np.concatenate([p[k] for p in parts])
            for k in ("values", "request", "position", "token_id")}


def test_every_row_comes_out_once_in_order(tmp_path):
    rng = np.random.default_rng(0)
    sink = SinkWriter(tmp_path, shard_rows=37)
    reqs = [sink.request_index(f"req-{i}") for i in range(5)]
    assert reqs == list(range(5)) and sink.request_index("req-2") == 2
    put = {s: [] for s in WIDTHS}
    for _ in range(60):
        site = list(WIDTHS)[int(rng.integers(len(WIDTHS)))]
        n = int(rng.integers(0, 30))
        piece = (rng.integers(0, 5, n), rng.integers(0, 500, n),
                 rng.normal(size=(n, WIDTHS[site])).astype(np.float32),
                 rng.integers(0, 32000, n))
        sink.put(site, *piece)
        put[site].append(piece)
    index = sink.close()
    assert index == json.loads((tmp_path / "index.json").read_text())
    assert index["requests"] == [f"req-{i}" for i in range(5)]
    for site, pieces in put.items():
        got = read_site(tmp_path, index, site)
        want = [np.concatenate([p[i] for p in pieces]) for i in range(4)]
        assert np.array_equal(got["request"], want[0])
        assert np.array_equal(got["position"], want[1])
        assert np.array_equal(got["values"], want[2])
        assert np.array_equal(got["token_id"], want[3])
        rows = [s["rows"] for s in index["shards"] if s["site"] == site]
        assert all(r == 37 for r in rows[:-1]) and 0 < rows[-1] <= 37
    assert not list(tmp_path.rglob(".*.tmp"))  # no half-written shard left


class SlowDisk(SinkWriter):
    """A writer held back (a slow disk): each piece takes 5 ms to take."""

    def _take(self, piece):
        time.sleep(0.005)
        super()._take(piece)


def test_backpressure_bounds_memory_and_drops_nothing(tmp_path):
    piece_bytes = 64 * 1024 * 4 + 64 * 16  # 64 rows of 1024 float32 + labels
    sink = SlowDisk(tmp_path, shard_rows=256, max_queued_bytes=3 * piece_bytes)
    values = np.ones((64, 1024), np.float32)
    for i in range(40):
        sink.put("blocks.0.hook_resid_post", np.zeros(64, np.int64),
                 np.arange(64) + 64 * i, values * i)
    index = sink.close()
    assert sink.peak_held <= 3 * piece_bytes
    assert sink.waits > 0  # the producer waited for the disk instead of queueing 10 MB
    got = read_site(tmp_path, index, "blocks.0.hook_resid_post")
    assert np.array_equal(got["position"], np.arange(64 * 40))
    assert np.array_equal(got["values"][::64, 0], np.arange(40, dtype=np.float32))


def test_rows_gathered_into_open_shards_count_against_the_bound(tmp_path):
    """Rows the writer has taken but not written (shards of many sites filling at once)
    are held memory too: with 8 sites and shards of 10,000 rows, nothing would be written
    until 80,000 rows had arrived, far past the bound. The writer writes its largest open
    shard early instead: no more rows are alive than the bound allows (plus the put in
    hand), and every row still comes out once, in order."""
    import weakref

    piece_bytes = 64 * 256 * 4 + 64 * 24
    bound = 4 * piece_bytes
    sink = SinkWriter(tmp_path, shard_rows=10_000, max_queued_bytes=bound)
    alive, peak = [0], [0]

    def gone():
        alive[0] -= 1

    sites = [f"blocks.{i}.hook_resid_post" for i in range(8)]
    for i in range(200):
        values = np.full((64, 256), i, np.float32)
        alive[0] += 1
        weakref.finalize(values, gone)
        sink.put(sites[i % 8], np.zeros(64, np.int64), np.arange(64) + 64 * (i // 8), values)
        del values
        peak[0] = max(peak[0], alive[0])
    index = sink.close()
    assert peak[0] * piece_bytes <= bound + piece_bytes, peak[0]
    assert sink.peak_held <= bound and sink.waits > 0
    for k, site in enumerate(sites):
        got = read_site(tmp_path, index, site)
        assert np.array_equal(got["position"], np.arange(64 * 25))
        assert np.array_equal(got["values"][::64, 0], np.arange(k, 200, 8, dtype=np.float32))


def test_a_failed_write_stops_the_sink_loudly(tmp_path):
    (tmp_path / "blocks.0.hook_resid_post").write_text("a file where a folder must go")
    sink = SinkWriter(tmp_path, shard_rows=4)
    sink.put("blocks.0.hook_resid_post", np.zeros(8, np.int64), np.arange(8),
             np.ones((8, 2), np.float32))
    with pytest.raises(SinkFailed, match="the writer stopped"):
        for _ in range(200):  # the writer fails on its first shard
            sink.put("blocks.0.hook_resid_post", np.zeros(1, np.int64), np.arange(1),
                     np.ones((1, 2), np.float32))
            time.sleep(0.01)
    with pytest.raises(SinkFailed):
        sink.close()


def test_mismatched_columns_are_refused(tmp_path):
    sink = SinkWriter(tmp_path)
    with pytest.raises(ValueError, match="3 positions, 2 request indices"):
        sink.put("s", np.zeros(2, np.int64), np.arange(3), np.ones((3, 2), np.float32))
    assert sink.close()["shards"] == []


def test_flush_writes_partial_shards_without_waiting(tmp_path):
    """flush() (the capture family's, when its last sink request leaves) writes each
    site's partial shard after the rows queued before it; later rows start new shards."""
    sink = SinkWriter(tmp_path, shard_rows=100)
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    sink.put("a", np.zeros(4, np.int64), np.arange(4), rows)
    sink.flush()
    deadline = time.monotonic() + 10
    while not (tmp_path / "index.json").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [s["rows"] for s in json.loads((tmp_path / "index.json").read_text())["shards"]] \
        == [4]
    sink.put("a", np.ones(2, np.int64), np.arange(2), rows[:2])
    index = sink.close()
    assert [s["rows"] for s in index["shards"]] == [4, 2]
    assert np.array_equal(read_site(tmp_path, index, "a")["values"],
                          np.concatenate([rows, rows[:2]]))


def test_positions_written_twice_are_listed(tmp_path):
    """A recomputed request (preemption) writes its positions again: index.json's
    `repeated` names it, so a reader keeps the last row of each position."""
    sink = SinkWriter(tmp_path, shard_rows=4)
    rows = np.zeros((3, 2), np.float32)
    sink.put("a", np.array([0, 0, 1]), np.array([0, 1, 0]), rows)
    sink.put("a", np.array([0, 1, 1]), np.array([2, 1, 2]), rows)  # request 0 goes on
    sink.put("b", np.array([0, 0, 0]), np.array([0, 1, 2]), rows)  # another site: its own
    sink.put("a", np.array([1, 1, 1]), np.array([0, 1, 2]), rows)  # request 1 recomputed
    assert sink.close()["repeated"] == [1]


def test_model_dtype_rows_keep_their_dtype_and_sync_waits_for_the_disk(tmp_path):
    """bfloat16 rows are written as bfloat16 (not widened: a harvest of a bf16 model
    would write twice the bytes); sync() returns once every row put is in a shard,
    partial shards included, and unknown token ids are -1."""
    import torch
    from safetensors.torch import load_file as load_torch

    sink = SlowDisk(tmp_path, shard_rows=1000)
    values = torch.randn(30, 16).to(torch.bfloat16)
    for i in range(3):
        sink.put("blocks.0.hook_resid_post", np.zeros(10, np.int64), np.arange(10) + 10 * i,
                 values[10 * i:10 * i + 10])
    index = sink.sync()
    assert [s["rows"] for s in index["shards"]] == [30]  # the partial shard, all rows
    got = load_torch(str(tmp_path / index["shards"][0]["file"]))
    assert got["values"].dtype == torch.bfloat16 and torch.equal(got["values"], values)
    assert got["token_id"].tolist() == [-1] * 30
    sink.put("blocks.0.hook_resid_post", np.zeros(5, np.int64), np.arange(30, 35),
             values[:5])
    assert [s["rows"] for s in sink.sync()["shards"]] == [30, 5]
    sink.close()


def test_the_index_is_rewritten_by_time_not_per_shard(tmp_path):
    """index.json listed every shard and was rewritten after each: with thousands of
    shards its rewrites cost more than the shards (quadratic). It is rewritten at most
    every INDEX_EVERY_S while the writers are busy, and is current once they are idle
    (sync, close)."""
    sink = SinkWriter(tmp_path, shard_rows=4, max_queued_bytes=1 << 30)
    values = np.zeros((4, 8), np.float32)
    for i in range(400):
        sink.put("blocks.0.hook_resid_post", np.zeros(4, np.int64), np.arange(4) + 4 * i,
                 values)
    index = sink.sync()
    assert len(index["shards"]) == 400
    assert json.loads((tmp_path / "index.json").read_text())["shards"] == index["shards"]
    assert sink.index_writes < 200, sink.index_writes
    sink.close()


def test_one_site_in_two_formats_starts_a_shard_per_format(tmp_path):
    """Two requests may sink one site in different dtypes (or heads): a shard holds one
    format, so the writer closes the open shard when the format changes. It wrote both
    into one shard before, which failed (pieces of different dtypes) and stopped the
    sink for every request."""
    import torch
    from safetensors.torch import load_file as load_torch

    sink = SinkWriter(tmp_path, shard_rows=100)
    bf16 = torch.randn(3, 4).to(torch.bfloat16)
    f32 = torch.randn(2, 4)
    sink.put("a", np.zeros(3, np.int64), np.arange(3), bf16)
    sink.put("a", np.ones(2, np.int64), np.arange(2), f32)
    sink.put("a", np.zeros(1, np.int64), np.arange(3, 4), bf16[:1])
    index = sink.close()
    shards = [load_torch(str(tmp_path / s["file"])) for s in index["shards"]]
    assert [s["rows"] for s in index["shards"]] == [3, 2, 1]
    assert [s["dtype"] for s in index["shards"]] == ["bfloat16", "float32", "bfloat16"]
    assert torch.equal(shards[0]["values"], bf16) and torch.equal(shards[1]["values"], f32)
    assert shards[2]["request"].tolist() == [0] and shards[2]["position"].tolist() == [3]


def test_a_short_writev_resumes_where_it_stopped(tmp_path):
    """Shards go out through writev, a batch of pieces a call; a call may write less
    than asked (a signal, a disk filling up) and the rest follows from there."""
    import os

    from graphtap.courier.shardfile import _write_all

    def trickle(fd, views):  # at most 5 bytes a call
        return os.write(fd, bytes(b"".join(bytes(v) for v in views)[:5]))

    buffers = [b"abc", np.arange(10, dtype=np.uint8), b"", b"defghijk"]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    _write_all(fd, buffers, writev=trickle)
    os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"abc" + bytes(range(10)) + b"defghijk"


def test_a_handover_of_several_sites_is_checked_and_split(tmp_path):
    """put_runs (one hand-over a step, every site's runs) refuses runs whose rows do not
    match their count, and writes each site's rows to its own shards."""
    sink = SinkWriter(tmp_path)
    a, b = np.ones((2, 3), np.float32), np.zeros((1, 3), np.float32)
    import torch
    with pytest.raises(ValueError, match="sink: 3 positions"):
        sink.put_runs(np.zeros(3), np.arange(3), np.zeros(3),
                      [("a", 1, [torch.from_numpy(a)]), ("b", 2, [torch.from_numpy(b)])])
    sink.put_runs(np.array([0, 1, 0]), np.array([4, 5, 6]), np.array([7, 8, 9]),
                  [("a", 2, [torch.from_numpy(a)]), ("b", 1, [torch.from_numpy(b)])])
    index = sink.close()
    got = read_site(tmp_path, index, "a")
    assert got["position"].tolist() == [4, 5] and got["token_id"].tolist() == [7, 8]
    assert np.array_equal(got["values"], a)
    assert read_site(tmp_path, index, "b")["request"].tolist() == [0]


class CopyStream:
    """Stands in for the sink's CUDA stream: chunks put as zeros get their bytes in the
    order they were queued, and an event's synchronize returns once every copy queued up
    to it has run (events of one stream complete in order), whichever writer thread runs
    them. A lock keeps two writers from seeing each other's copies half done (the first
    version popped a copy and ran it outside any lock: a second writer could return
    before the copy it needed had landed, and write zeros). `slow`: {copy number: the
    seconds it takes}."""

    def __init__(self, slow: dict | None = None):
        self.pending, self.done, self.waits = [], 0, 0
        self.slow, self._lock = slow or {}, threading.Lock()

    def event(self, chunk, value):
        self.pending.append((chunk, value))
        stream, upto = self, len(self.pending)

        class Event:
            def synchronize(self):
                with stream._lock:
                    stream.waits += 1
                    while stream.done < upto:
                        c, v = stream.pending[stream.done]
                        time.sleep(stream.slow.get(stream.done, 0.0))
                        c.copy_(v)
                        stream.done += 1
        return Event()


def _four_steps_on_their_way(tmp_path, stream: CopyStream, offset: float = 0.0):
    """Four sink steps of 2 rows, each handed over with its copy still queued on
    `stream`, into shards of 6 rows; the writer closed. Returns the index and the rows."""
    import torch

    sink = SinkWriter(tmp_path, shard_rows=6)
    want = torch.arange(24, dtype=torch.float32).reshape(8, 3) + offset
    for i in range(4):
        chunk = torch.zeros(2, 3)
        ready = stream.event(chunk, want[2 * i:2 * i + 2])
        sink.put_runs(np.zeros(2), np.arange(2 * i, 2 * i + 2), np.zeros(2),
                      [("a", 2, [chunk])], ready)
    return sink.close(), want


def test_rows_still_on_their_way_are_written_after_their_copy_event(tmp_path):
    """A sink step's rows come home on the sink's own stream (not gating vLLM's token
    copy): the writer gets them with the copy's event and waits for it before it writes,
    once per shard (the latest event of its pieces)."""
    stream = CopyStream()
    index, want = _four_steps_on_their_way(tmp_path, stream)
    assert [s["rows"] for s in index["shards"]] == [6, 2]
    assert np.array_equal(read_site(tmp_path, index, "a")["values"], want.numpy())
    assert stream.waits == 2  # one wait per shard


@pytest.mark.parametrize("attempt", range(4))
def test_each_shard_waits_for_its_own_copy_while_another_writer_runs_the_copies(
        tmp_path, attempt):
    """Two writer threads wait on the same stream at once (the first shard's and, at
    close, the tail's) while the last copy takes a while: each shard's rows are there
    when it is written. Regression: the first test stream let the tail's writer return
    while the other writer was still running the tail's copy (CI wrote the tail as
    zeros; with the slow copy it failed about one attempt in four)."""
    index, want = _four_steps_on_their_way(tmp_path, CopyStream(slow={3: 0.05}), attempt)
    assert [s["rows"] for s in index["shards"]] == [6, 2]
    assert np.array_equal(read_site(tmp_path, index, "a")["values"], want.numpy())
