"""The bulk sink's writer: labelled rows appended to sharded safetensors files by threads
of their own, so a harvest's rows leave the engine core's thread as soon as they are
handed over (issue 18). The capture family sends it the rows of entries marked
`"sink": true` (engine/families/capture.py), which never go back with their request.

Layout under `root`: per site a folder (`blocks.12.hook_resid_post/`) of shards
`shard-00000.safetensors`, each with `values` [rows, width] in the entry's dtype
(bfloat16 stays bfloat16), `request` (an index into the requests of `index.json`),
`position` and `token_id` (the input token there, read on the device). `index.json`
lists the requests and every shard (rows, bytes, dtype, row shape): current whenever
the writers are idle (and after sync/close), at most INDEX_EVERY_S stale while they
write (rewriting it per shard cost more than the shards once there were thousands).
`repeated` lists the requests with a position written twice (courier/repeats.py).
Shards are written under a temporary name and renamed, by `writers` threads at once
(one thread's copies into the page cache were the limit on the H200 host): a reader
never sees half a shard. A shard holds one format: two requests sinking one site in
different dtypes or heads get shards of their own.

A step's rows arrive in one hand-over (`put_runs`: every site's runs); on a GPU they are
still on their way home on the sink's own copy stream, into pinned staging memory
(courier/staging.py): the writer waits for the copy's event before it writes them, so
vLLM's sampled tokens never wait for a harvest's bytes.

Memory is bounded: `put` blocks while the rows the writer holds, queued or gathered
into shards not yet written, would pass `max_queued_bytes` (backpressure: the engine
slows, nothing is dropped); one put larger than the bound alone still goes through.
While a put waits the writer writes its largest open shard early, as a shorter one (a
shard of every site open at once, 32 layers x 65536 rows of 8 KiB, would hold 16 GiB).
A failed write (a full disk) stops the writer and every later `put` raises SinkFailed
with the cause: rows are never lost silently."""
from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from graphtap.courier.repeats import Repeats
from graphtap.courier.sink_labels import owned_int64
from graphtap.courier.shardfile import split_pieces, write_pieces
from graphtap.courier.staging import Staging

INDEX = "index.json"
INDEX_EVERY_S = 0.5
STAGE_WAIT_S = 30.0  # the longest a step copy waits for staging memory


class SinkFailed(RuntimeError):
    """The writer stopped on an error; rows put since were not written."""


class SinkWriter:
    """Rows in (`put`, any thread), sharded files out (its own thread)."""

    def __init__(self, root: str | Path, shard_rows: int = 1 << 16,
                 max_queued_bytes: int = 256 << 20, writers: int = 4,
                 staging: Staging | None = None):
        if shard_rows < 1 or max_queued_bytes < 1 or writers < 1:
            raise ValueError("sink: shard_rows, max_queued_bytes and writers must be at "
                             "least 1")
        self.staging = staging  # pinned memory the step copies are cut from (GPU)
        self.staged = self.unstaged = 0  # step copies into it, and those that fell back
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.shard_rows, self.max_queued_bytes = shard_rows, max_queued_bytes
        self._requests: dict[str, int] = {}
        self._queue: deque = deque()
        self._held = 0  # bytes put and not yet written: queued, and in open shards
        self._waiting = 0  # puts waiting for room
        self.peak_held = 0  # the most bytes ever held (tests hold it to the bound)
        self.waits = 0  # puts that waited for room (backpressure applied)
        self.wait_s = 0.0  # the time they waited, in all
        self._cv = threading.Condition()
        self._closing = False
        self._error: BaseException | None = None
        self._open: dict[str, list] = {}  # site -> pending pieces of its next shard
        self._open_rows: dict[str, int] = {}  # site -> rows in them
        self._count: dict[str, int] = {}  # site -> shards written
        self._shards: list[dict] = []
        self._open_fmt: dict[str, tuple] = {}  # site -> its open shard's (dtype, shape)
        self._repeats = Repeats()  # positions written twice (a preempted request)
        self._busy = False  # the thread holds a piece it has taken off the queue
        self._inflight = 0  # shards handed to the writers, not yet written
        self._pool = ThreadPoolExecutor(writers, thread_name_prefix="graphtap-sink-write")
        self._index_lock = threading.RLock()
        self._index_at = 0.0  # when index.json was last written (time.monotonic)
        self.index_writes = 0
        self._thread = threading.Thread(target=self._run, name="graphtap-sink", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- producer side
    def stage(self, like: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """A block of the staging memory to copy a step's rows (`like`) into: (its
        offset, a host tensor shaped like them), or None where torch's allocator takes
        it: no staging, a copy over half of it (two steps must fit), a stopped writer,
        or a full one that only steps not yet handed over hold (they free after this
        one: waiting would never end). Waits while the writer will free a block (the
        engine slows, as in put); settle() after the hand-over."""
        staging = self.staging
        nbytes = like.numel() * like.element_size()
        if staging is None:
            return None
        if not 0 < nbytes <= staging.size // 2:
            self.unstaged += 1
            return None
        with self._cv:
            waited, t0 = False, time.monotonic()
            try:
                while self._error is None and not self._closing:
                    offset = staging.take(nbytes)
                    if offset is not None:
                        self.staged += 1
                        return offset, staging.view(offset, like)
                    if not staging.freeable():
                        break
                    if waited and time.monotonic() - t0 > STAGE_WAIT_S:
                        break  # never expected: torch's allocator is always safe
                    waited = True
                    self._await_room(0.5)
                self.unstaged += 1
                return None
            finally:
                self.waits += waited
                self.wait_s += (time.monotonic() - t0) if waited else 0.0

    def _await_room(self, timeout: float | None = None) -> None:
        """Waits (holding self._cv) for the writer to free memory, telling it that a
        producer waits: with nothing being written it writes its largest shard early."""
        self._waiting += 1
        self._cv.notify_all()
        self._cv.wait(timeout)
        self._waiting -= 1

    def settle(self, offset: int, handed: int) -> None:
        """The step that staged its rows at `offset` handed `handed` bytes of them to
        the writer (views; 0: none): the block is freed once they are written."""
        with self._cv:
            if self.staging.settle(offset, handed):
                self._cv.notify_all()

    def request_index(self, req_id: str) -> int:
        """The request's row in index.json (its rows' `request` value)."""
        with self._cv:
            return self._requests.setdefault(req_id, len(self._requests))

    def put(self, site: str, request: np.ndarray, position: np.ndarray,
            values, token: np.ndarray | None = None) -> None:
        """Rows of one site: request indices, positions, values [n, width] (a tensor,
        an array, or a list of tensors whose rows follow each other: views of a step
        buffer are written from where they are), the input token ids (None: -1)."""
        n = len(position)
        token = np.full(n, -1, np.int64) if token is None else token
        chunks = [torch.as_tensor(v) for v in values] if isinstance(values, list) else \
            [torch.as_tensor(values)]
        self.put_runs(request, position, token, [(site, n, chunks)])

    def put_runs(self, request: np.ndarray, position: np.ndarray, token: np.ndarray,
                 runs: list[tuple[str, int, list[torch.Tensor]]], ready=None) -> None:
        """A step's rows of several sites in one hand-over (one lock, one queue entry:
        a decode step of every layer is 32 sites, and each hand-over costs the engine's
        thread the GIL): runs of (site, rows, chunks whose rows follow each other),
        labelled in order by request (or SlotRequests), position and token (integer
        arrays; views are copied in the writer's thread, never tables the next step
        changes in place). `ready`: an event (CUDA) after which the chunks' bytes are
        there (they are still being copied home on the sink's one stream, so a later
        event implies every earlier one); None: now."""
        n = len(position)
        rows = sum(len(c) for _, _, chunks in runs for c in chunks)
        if not (len(request) == n == rows == len(token) == sum(r[1] for r in runs)) or any(
                sum(len(c) for c in chunks) != count for _, count, chunks in runs):
            raise ValueError(f"sink: {n} positions, {len(request)} request indices, "
                             f"{len(token)} token ids and {rows} rows")
        if not n:
            return
        runs = [(site, count, [c if c.is_contiguous() else c.contiguous()
                               for c in chunks if len(c)]) for site, count, chunks in runs
                if count]
        piece = (request, position, token, runs, ready)
        size = 24 * n + sum(c.numel() * c.element_size() for *_, chunks in runs for c in chunks)
        with self._cv:
            waited, t0 = False, time.monotonic()
            while (self._error is None and self._held
                   and self._held + size > self.max_queued_bytes):
                waited = True
                self._await_room()  # backpressure: the writer frees room as it writes
            self.waits += waited
            self.wait_s += (time.monotonic() - t0) if waited else 0.0
            if self._error is not None:
                raise SinkFailed(f"sink: the writer stopped: {self._error!r}")
            if self._closing:
                raise SinkFailed("sink: closed")
            self._queue.append(piece)
            self._held += size
            self.peak_held = max(self.peak_held, self._held)
            self._cv.notify_all()

    def flush(self) -> None:
        """Write every partial shard once the rows queued before it are written (no
        wait here): the family asks when its last sink request has left."""
        with self._cv:
            if self._error is None and not self._closing:
                self._queue.append(None)
                self._cv.notify_all()

    def sync(self, timeout: float = 600.0) -> dict:
        """Write every partial shard and wait until everything put before is on disk;
        returns the index (the worker answers `graphtap_sink_sync` with it, so a
        harvest reads its requests' rows once they are all written)."""
        self.flush()
        with self._cv:
            if not self._cv.wait_for(lambda: self._error is not None or (
                    not self._queue and not self._busy and not self._inflight), timeout):
                raise SinkFailed(f"sink: not written within {timeout} s")
            if self._error is not None:
                raise SinkFailed(f"sink: the writer stopped: {self._error!r}")
        with self._index_lock:
            return self._write_index()

    def close(self) -> dict:
        """Write what is queued and every partial shard; returns the index."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()
        self._pool.shutdown(wait=True)
        if self.staging is not None and self.staging.idle():  # else a copy may target it
            self.staging.close()
        if self._error is not None:
            raise SinkFailed(f"sink: the writer stopped: {self._error!r}")
        with self._index_lock:
            return self._write_index()

    def stats(self) -> dict:
        """Backpressure so far, and why the writer stopped if it did (the engine's stats
        endpoint shows it per worker)."""
        return {"waits_total": self.waits, "wait_s_total": round(self.wait_s, 3),
                "peak_held_bytes": self.peak_held, "held_bytes": self._held,
                "staging_bytes": 0 if self.staging is None else self.staging.size,
                "staged_total": self.staged, "unstaged_total": self.unstaged,
                "error": None if self._error is None else repr(self._error)}

    # ---------------------------------------------------------------- writer thread
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._queue and not self._closing and not self._stuck() \
                            and self._error is None:
                        self._cv.wait()
                    if self._error is not None:
                        return
                    if not self._queue and not self._stuck():
                        break  # closing, everything taken
                    early = not self._queue  # a put waits: free room now
                    piece = None if early else self._queue.popleft()
                    self._busy = True
                if early:
                    self._flush(max(self._open_rows, key=self._open_rows.get))
                elif piece is None:  # flush()
                    for site in list(self._open):
                        self._flush(site)
                else:
                    self._take(piece)
                piece = None  # the taken rows live in open shards now, or are written
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
            for site in list(self._open):
                self._flush(site)
        except BaseException as e:  # noqa: BLE001 - reported to every later put
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _stuck(self) -> bool:
        """A put waits for room and nothing is being written: a shard must go early."""
        return bool(self._waiting and self._open and not self._inflight)

    def _take(self, piece) -> None:
        request, position, token, runs, ready = piece
        request, position, token = map(owned_int64, (request, position, token))
        self._repeats.note(request, position, runs)
        at = 0
        for site, count, chunks in runs:
            fmt = (chunks[0].dtype, tuple(chunks[0].shape[1:]))
            if self._open_fmt.get(site, fmt) != fmt:
                self._flush(site)  # a shard holds one format (requests may differ)
            self._open_fmt[site] = fmt
            self._open.setdefault(site, []).append(
                (request[at:at + count], position[at:at + count], token[at:at + count],
                 chunks, ready))
            at += count
            self._open_rows[site] = self._open_rows.get(site, 0) + count
            while self._open_rows.get(site, 0) >= self.shard_rows:
                self._flush(site, self.shard_rows)

    def _flush(self, site: str, rows: int | None = None) -> None:
        """Write the site's first `rows` pending rows (all: None) as its next shard."""
        pending = self._open.pop(site, [])
        self._open_rows.pop(site, None)
        fmt = self._open_fmt.pop(site, None)
        if not pending:
            return
        request, position, token = (np.concatenate([p[i] for p in pending]) for i in range(3))
        chunks = [c for p in pending for c in p[3]]
        # the latest copy event of the pieces (one stream: it implies the earlier ones)
        ready = next((p[4] for p in reversed(pending) if p[4] is not None), None)
        if rows is not None and rows < len(position):
            chunks, rest = split_pieces(chunks, rows)
            self._open[site] = [(request[rows:], position[rows:], token[rows:], rest, ready)]
            self._open_rows[site] = len(position) - rows
            self._open_fmt[site] = fmt
            request, position, token = request[:rows], position[:rows], token[:rows]
        k = self._count.get(site, 0)
        self._count[site] = k + 1
        with self._cv:
            self._inflight += 1
        # the rows travel in a list the writer empties before it gives their bytes back:
        # no reference (these locals, the pool's work item) outlives the accounting
        job = [request, position, token, chunks, ready]
        del request, position, token, chunks, pending, ready
        self._pool.submit(self._write, site, k, job)

    def _write(self, site: str, k: int, job: list) -> None:
        """One shard's file (a writer thread)."""
        request, position, token, chunks, ready = job
        job.clear()
        try:
            if ready is not None:
                ready.synchronize()  # the rows' copy home has run (releases the GIL)
            folder = self.root / site
            folder.mkdir(exist_ok=True)
            name = f"shard-{k:05d}.safetensors"
            tmp = folder / f".{name}.tmp"
            write_pieces(tmp, {"values": chunks, "request": [torch.from_numpy(request)],
                               "position": [torch.from_numpy(position)],
                               "token_id": [torch.from_numpy(token)]})
            os.replace(tmp, folder / name)
            shard = {"site": site, "file": f"{site}/{name}", "rows": int(len(position)),
                     "bytes": (folder / name).stat().st_size,
                     "dtype": str(chunks[0].dtype).removeprefix("torch."),
                     "shape": list(chunks[0].shape[1:])}
            with self._index_lock:
                self._shards.append(shard)
                with self._cv:
                    last = self._inflight == 1 and not self._queue  # the writers go idle
                if last or time.monotonic() - self._index_at >= INDEX_EVERY_S:
                    self._write_index()
            error = None
        except BaseException as e:  # noqa: BLE001 - reported to every later put
            error = e
        written = 24 * len(position) + sum(c.numel() * c.element_size() for c in chunks)
        staged = [(c.data_ptr(), c.numel() * c.element_size()) for c in chunks] \
            if self.staging is not None else ()
        del request, position, token, chunks, ready  # a pinned step buffer goes back once its
        # last view is written
        with self._cv:  # 3 int64 labels a row and the values: what put counted
            try:  # staging blocks go back once every byte handed over is written
                for ptr, nbytes in staged:
                    self.staging.release(ptr, nbytes)
            except RuntimeError as e:  # its accounting broke: stop loudly, not hang
                error = error or e
            self._held -= written
            self._inflight -= 1
            if error is not None and self._error is None:
                self._error = error
            self._cv.notify_all()

    def written(self) -> dict:
        """The index of what is written so far, without writing index.json (also a
        stopped writer's, whose index write may be what failed)."""
        with self._cv:
            requests = sorted(self._requests, key=self._requests.get)
        with self._index_lock:  # each site's shards in order (writers finish in any)
            shards = sorted(self._shards, key=lambda s: s["file"])
        return {"graphtap_sink": 1, "requests": requests, "shards": shards,
                "repeated": sorted(self._repeats.requests)}

    def _write_index(self) -> dict:
        """Rewrites index.json; returns the index written."""
        self._index_at = time.monotonic()
        self.index_writes += 1
        index = self.written()
        tmp = self.root / f".{INDEX}.tmp"
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, self.root / INDEX)
        return index

