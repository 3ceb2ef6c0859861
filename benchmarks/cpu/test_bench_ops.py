"""CPU micro-benchmarks of the graph ops and the per-step scheduler (pytest-benchmark).

Targets live here, never in tests/: an idle site must cost next to nothing, and the
per-step routing must stay well under a millisecond for a full decode batch.
Run: `make bench` (or `pytest benchmarks/cpu --benchmark-only`).
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from graphtap.capture_scheduler import CaptureScheduler
from graphtap.ops.capture import capture_reference
from graphtap.ops.steer import steer_reference
from graphtap.scheduler import SteerScheduler, position_bitmap
from graphtap.sites import SiteTable, expand_patterns
from graphtap.tables import CaptureTables, SteerTables

H, R, E, V, L = 1024, 64, 8, 64, 2048


def steer_tables(active: bool):
    t = SteerTables.allocate(max_reqs=R, max_tokens=512, max_steers=E, max_vectors=V, hidden=H,
                             max_len=L, dtype=torch.float32, device="cpu")
    t.bank[1:] = torch.randn(V, H)
    t.inv_norm[1:] = 1 / t.bank[1:].norm(dim=1)
    if active:
        t.ent_site[:R, 0], t.ent_vec[:R, 0], t.ent_a[:R, 0] = 0, 1, 2.0
        t.ent_pos[:R, 0] = torch.from_numpy(position_bitmap("all", 8, L, t.ent_pos.shape[2]))
        t.tok_slot[:] = torch.arange(512) % R
    return t


@pytest.mark.parametrize("tokens", [64, 512])
@pytest.mark.parametrize("active", [False, True], ids=["idle", "steering"])
def test_steer_op(benchmark, tokens, active):
    t = steer_tables(active)
    x, other, pos = torch.randn(tokens, H), torch.randn(tokens, H), torch.arange(tokens)
    benchmark(steer_reference, t, x, other, pos, 0)


@pytest.mark.parametrize("tokens", [64, 512])
def test_capture_op(benchmark, tokens):
    t = CaptureTables.allocate(max_reqs=R, max_tokens=512, max_captures=4, num_sites=4,
                               rows=1024, hidden=H, max_len=L, device="cpu")
    t.cap_dst[0, :tokens] = torch.arange(tokens)
    x, other = torch.randn(tokens, H), torch.randn(tokens, H)
    benchmark(capture_reference, t, x, other, 0)


def batch(num_reqs: int, tokens_each: int):
    n = num_reqs * tokens_each
    qsl = np.arange(0, n + 1, tokens_each, dtype=np.int32)
    return SimpleNamespace(
        req_ids=[f"r{i}" for i in range(num_reqs)], num_reqs=num_reqs, num_tokens=n,
        num_tokens_after_padding=n, query_start_loc_np=qsl,
        query_start_loc=torch.from_numpy(qsl), idx_mapping=torch.arange(num_reqs, dtype=torch.int32),
        num_scheduled_tokens=np.full(num_reqs, tokens_each), positions=torch.arange(n) % 100)


@pytest.mark.parametrize("num_reqs", [8, 64])
def test_scheduler_step(benchmark, num_reqs):
    """Routing plus capture rows for a decode batch where every request steers and
    captures one site (the layout changes each call, so nothing is skipped)."""
    sites = SiteTable(expand_patterns(["blocks.*.hook_resid_post"], 32))
    t = steer_tables(False)
    ct = CaptureTables.allocate(max_reqs=R, max_tokens=512, max_captures=4, num_sites=len(sites),
                                rows=1024, hidden=H, max_len=L, device="cpu")
    steer = SteerScheduler(t, sites, torch.device("cpu"))
    cap = CaptureScheduler(ct, sites, L, torch.float32, torch.device("cpu"),
                           {"resid_post": (H, 0)})
    vec = np.ones(H, np.float32).tobytes()
    hooks = {"steer": [{"layer": 3, "kind": "resid_post", "vector": vec, "key": "k", "a": 1.0,
                        "lo": -np.inf, "hi": np.inf, "positions": "all"}],
             "capture": [{"layer": 5, "kind": "resid_post", "name": "blocks.5.hook_resid_post",
                          "dtype": "float32", "heads": None, "positions": "generated"}]}
    for i in range(num_reqs):
        steer.add_request(i, f"r{i}", 8, hooks)
        cap.add_request(i, f"r{i}", 8, hooks)
    b = batch(num_reqs, 1)

    def step():
        steer._last_layout = None
        steer.prepare_step(b, False, cap.holds)
        cap.prepare_step(b, t.tok_slot, False)
        return cap.collect(b, False)

    benchmark(step)


@pytest.mark.parametrize("context", [256, 2048])
def test_pattern_op(benchmark, context):
    """Attention patterns of 32 (query, head) rows over `context` keys, from a paged
    cache (torch reference; the GPU runs the Triton kernel)."""
    from graphtap.ops.pattern import KeyCache, pattern_reference
    from graphtap.tables import PatternTables

    heads, kv_heads, dim, bs = 32, 8, 128, 32
    blocks = context // bs * 4
    t = PatternTables.allocate(max_reqs=R, max_captures=4, num_heads=heads, rows=256,
                               max_len=L, device="cpu")
    for i in range(32):  # 4 requests x 8 heads, last position
        t.route[i] = torch.tensor([0, i // 8, i % 8 * 4, i // 8, context - 1, i // 8])
    table = torch.arange(blocks, dtype=torch.int32).view(4, -1)
    kc = KeyCache(torch.randn(blocks, bs, kv_heads, dim), table, dim ** -0.5, heads // kv_heads)
    q = torch.randn(4, heads, dim)
    benchmark(pattern_reference, t, q, kc, 0)


def step_snapshot(reqs: int, rows_each: int, load: str):
    """One step's pinned rows as the device writes them (site-major, requests adjacent;
    bf16 buffer, Llama-3-8B width 4096). dump: residuals at 3 sites, every token; qk:
    q at the last token and k at every token, 4 layers, 4 of 8 kv heads (k rows use 512
    of the 4096 columns). The rows arrive narrowed to the columns the step's formats read,
    as CaptureScheduler clones them (qk: heads 0-3 of q and k, 512 columns)."""
    from graphtap.courier import CaptureSnapshot, columns

    width, formats, names, labels = 4096, {}, {}, []
    sites = 3 if load == "dump" else 8
    for s in range(sites):
        k = load == "qk" and s % 2 == 1
        names[s] = f"blocks.{s}.attn.hook_{'kq'[s % 2 == 0]}" if load == "qk" else \
            f"blocks.{s}.hook_resid_post"
        for r in range(reqs):
            formats[(r, s)] = (torch.bfloat16, width, None, 0) if load == "dump" else \
                (torch.bfloat16, 1024 if k else width, (0, 1, 2, 3), 128)
            last = load == "qk" and not k
            labels += [(r, s, p) for p in range(rows_each) if not last or p == rows_each - 1]
    n, cols = len(labels), max(map(columns, formats.values()))
    return CaptureSnapshot(torch.randn(n, cols).to(torch.bfloat16), torch.tensor(labels),
                           torch.tensor([n]), {r: f"r{r}" for r in range(reqs)}, formats,
                           names, 1 << 20)


@pytest.mark.parametrize("reqs,rows_each,load", [(64, 1, "dump"), (16, 256, "dump"),
                                                 (8, 256, "qk")],
                         ids=["decode64", "prefill16", "qk-prefill8"])
def test_courier_split(benchmark, reqs, rows_each, load):
    """The host side of the courier for one step: rows split per request (the
    capture-throughput bottleneck measured on the H200). qk-prefill8: a Llama-3-8B qk
    prefill step of 8 x 256 tokens; copying whole 4096-wide rows for k rows that use
    1024 made it 12 ms here (and +20 % TPOT at 64 requests at once on the H200); 1.5 ms
    since, and 0.6 ms once adjacent chosen heads are copied as slices instead of gathered
    (advanced indexing was the top host op of qk on the H200 host). Seventh session: 1.72
    ms with whole rows vs 0.41 ms with the rows narrowed to the 512 columns the step's
    formats read, back to back here (the scheduler clones only those since)."""
    snap = step_snapshot(reqs, rows_each, load)
    out = benchmark(snap.per_request)
    name = snap.site_names[1]
    assert len(out) == reqs and out["r0"][name].shape[0] == rows_each
