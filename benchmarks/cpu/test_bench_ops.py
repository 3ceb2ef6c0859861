"""CPU micro-benchmarks of the graph ops, the per-step routing and the courier's split
(pytest-benchmark).

Targets live here, never in tests/: an idle site must cost next to nothing, and the
per-step routing must stay well under a millisecond for a full decode batch.
Run: `make bench` (or `pytest benchmarks/cpu --benchmark-only`).
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from graphtap.courier import CaptureStep, OverflowKind, RowFormat, StepRows, columns
from graphtap.courier.pack import unpack
from graphtap.courier.payload import open_payload
from graphtap.engine.families.capture import CaptureFamily
from graphtap.engine.families.steer import SteerFamily
from graphtap.engine.families.vectors import VectorBank
from graphtap.engine.router import TokenRouter
from graphtap.engine.tables import Sizes, allocate
from graphtap.ops.backend import TORCH
from graphtap.ops.capture import capture_reference
from graphtap.ops.pattern import pattern_reference
from graphtap.ops.steer import steer_reference
from graphtap.ops.tables import KeyCache, Label
from graphtap.spec import CaptureEntry, NormalisedSpec, SteerEntry
from graphtap.spec.positions import position_bitmap
from graphtap.spec.sites import SiteTable, expand_patterns

H, R, E, V, L = 1024, 64, 8, 64, 2048


def tables(sites: int = 4, patterns: bool = False, heads: int = 32):
    return allocate(Sizes(max_reqs=R, max_tokens=512, max_len=L, num_sites=sites, hidden=H, steer_width=H,
                          dtype=torch.float32, max_steers=E, max_vectors=V, max_captures=4,
                          capture_rows=1024, capture_width=H, pattern_rows=256,
                          num_heads=heads, patterns=patterns), TORCH, torch.device("cpu"))


def steer_tables(active: bool):
    et = tables()
    t = et.ops.steer
    t.bank[1:] = torch.randn(V, H)
    t.inv_norm[1:] = 1 / t.bank[1:].norm(dim=1)
    tok_slot = torch.full((512,), R)
    if active:
        t.site[:R, 0], t.vec[:R, 0], t.coef[:R, 0, 0] = 0, 1, 2.0
        t.pos[:R, 0] = torch.from_numpy(position_bitmap("all", 8, L, t.pos.shape[2]))
        tok_slot[:] = torch.arange(512) % R
    return t, tok_slot


@pytest.mark.parametrize("tokens", [64, 512])
@pytest.mark.parametrize("active", [False, True], ids=["idle", "steering"])
def test_steer_op(benchmark, tokens, active):
    t, tok_slot = steer_tables(active)
    x, other, pos = torch.randn(tokens, H), torch.randn(tokens, H), torch.arange(tokens)
    benchmark(steer_reference, t, tok_slot, x, other, pos, 0)


@pytest.mark.parametrize("tokens", [64, 512])
def test_capture_op(benchmark, tokens):
    t = tables().ops.capture
    t.dst[0, :tokens] = torch.arange(tokens)
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
    et = tables(sites=len(sites))
    steer = SteerFamily(et, sites, VectorBank(et.ops.steer))
    cap = CaptureFamily(et.ops.capture, et.capture, et.slots, widths={"resid_post": (H, 0)},
                        backend=TORCH, sites=sites, max_len=L, model_dtype=torch.float32)
    router = TokenRouter(et.ops)
    vec = np.ones(H, np.float32).tobytes()
    spec = NormalisedSpec(
        steer=(SteerEntry(3, "resid_post", vec, "k", 1.0, -np.inf, np.inf, "all"),),
        capture=(CaptureEntry(5, "resid_post", "blocks.5.hook_resid_post", "float32", None,
                              "generated"),))
    for i in range(num_reqs):
        steer.add_request(i, f"r{i}", 8, spec)
        cap.add_request(i, f"r{i}", 8, spec)
    et.slots.apply()
    steer.apply_staged_writes()
    b = batch(num_reqs, 1)

    def step():
        router.invalidate()
        plans = [steer.plan(b), cap.plan(b)]
        router.route(b)
        cap.route(b, router, plans[1])
        return cap.snapshot()

    benchmark(step)


@pytest.mark.parametrize("context", [256, 2048])
def test_pattern_op(benchmark, context):
    """Attention patterns of 32 (query, head) rows over `context` keys, from a paged
    cache (torch reference; the GPU runs the Triton kernel)."""
    heads, kv_heads, dim, bs = 32, 8, 128, 32
    blocks = context // bs * 4
    t = tables(patterns=True, heads=heads).ops.pattern
    for i in range(32):  # 4 requests x 8 heads, last position
        for col, v in ((Label.SITE, 0), (Label.TOKEN, i // 8), (Label.HEAD, i % 8 * 4),
                       (Label.BATCH_ROW, i // 8), (Label.POSITION, context - 1),
                       (Label.SLOT, i // 8)):
            t.labels[i, col] = v
    table = torch.arange(blocks, dtype=torch.int32).view(4, -1)
    kc = KeyCache(torch.randn(blocks, bs, kv_heads, dim), table, dim ** -0.5, heads // kv_heads)
    q = torch.randn(4, heads, dim)
    benchmark(pattern_reference, t, q, kc, 0)


def step_snapshot(reqs: int, rows_each: int, load: str):
    """One step's pinned rows as the device writes them (site-major, requests adjacent;
    bf16 buffer, Llama-3-8B width 4096). dump: residuals at 3 sites, every token; qk:
    q at the last token and k at every token, 4 layers, 4 of 8 kv heads (k rows use 512
    of the 4096 columns). The rows arrive narrowed to the columns the step's formats read,
    as the capture family clones them (qk: heads 0-3 of q and k, 512 columns)."""
    width, layout, names, labels = 4096, {}, {}, []
    sites = 3 if load == "dump" else 8
    for s in range(sites):
        k = load == "qk" and s % 2 == 1
        names[s] = f"blocks.{s}.attn.hook_{'kq'[s % 2 == 0]}" if load == "qk" else \
            f"blocks.{s}.hook_resid_post"
        layout[s] = RowFormat(torch.bfloat16, width, None, 0) if load == "dump" else \
            RowFormat(torch.bfloat16, 1024 if k else width, (0, 1, 2, 3), 128)
        for r in range(reqs):
            last = load == "qk" and not k
            labels += [(r, s, p) for p in range(rows_each) if not last or p == rows_each - 1]
    formats = dict.fromkeys(range(reqs), layout)  # shared, as by requests of one spec
    n, cols = len(labels), max(columns(f) for f in layout.values())
    labels = torch.tensor(labels)
    count = torch.cat([torch.tensor([n]), torch.bincount(labels[:, 0], minlength=reqs + 1)])
    return CaptureStep(StepRows(torch.randn(n, cols).to(torch.bfloat16), labels, count,
                                {r: f"r{r}" for r in range(reqs)}, formats, names, 1 << 20,
                                OverflowKind.CAPTURE_ROWS))


@pytest.mark.parametrize("reqs,rows_each,load", [(64, 1, "dump"), (16, 256, "dump"),
                                                 (8, 256, "qk"), (1, 1, "dump"),
                                                 (8, 1, "dump")],
                         ids=["decode64", "prefill16", "qk-prefill8", "hs-first1", "hs-step8"])
def test_courier_split(benchmark, reqs, rows_each, load):
    """The host side of the courier for one step: rows split per request (the
    capture-throughput bottleneck measured on the H200; figures in
    benchmarks/results/README.md). hs-first1 / hs-step8: the last-prompt rows (3 sites)
    of a burst's first step (request 0 alone) and of a prefill step of 8 requests,
    split in plain Python (CaptureStep.small_rows), which the burst's next admissions
    wait for."""
    snap = step_snapshot(reqs, rows_each, load)
    out = benchmark(snap.per_request)
    name = snap.site_names[1]
    assert len(out) == reqs and unpack(out["r0"])[name].shape[0] == rows_each


def mixed_qk_step(rows=None) -> CaptureStep:
    """A qk burst's usual step: 8 requests' prefills (k at 256 positions, q at the last,
    4 layers, heads 0-3: 512 columns) beside 56 decoding ones (a row at each of the 8
    sites), rows site-major as the device writes them."""
    fmt = RowFormat(torch.bfloat16, 512, (0, 1, 2, 3), 128)
    labels = [(r, s, p) for s in range(8) for r in range(64)
              for p in ([300] if r < 56 else range(256) if s % 2 else [255])]
    n, at = len(labels), torch.tensor(labels)
    return CaptureStep(StepRows(
        torch.randn(n, 512).to(torch.bfloat16) if rows is None else rows, at,
        torch.cat([torch.tensor([n]), torch.bincount(at[:, 0], minlength=65)]),
        {r: f"r{r}" for r in range(64)}, dict.fromkeys(range(64), dict.fromkeys(range(8), fmt)),
        {s: f"blocks.{s}.attn.hook_{'qk'[s % 2]}" for s in range(8)}, 1 << 20,
        OverflowKind.CAPTURE_ROWS))


def test_uniform_check_of_a_mixed_step(benchmark):
    """Whether a step's requests all ask the same (uniform.uniform_formats) on a qk
    burst's usual step (mixed_qk_step). The answer is no, and is asked twice a step (the
    direct seal, then split_uniform): each request's row count, taken before any sort,
    says so where a decoding request's rows come first."""
    from graphtap.courier.rows import ORDER
    from graphtap.courier.uniform import uniform_formats

    step = mixed_qk_step()
    found = step.sorted_labels(ORDER)
    assert benchmark(lambda: uniform_formats(step, *found, ORDER)) is None


@pytest.mark.parametrize("spec", ["valid-8x4096", "packed-8x4096", "packed-1x4096",
                                  "junk-5MB"])
def test_spec_validation(benchmark, spec):
    """Admission of a large spec runs on the API server's event loop (issue 16, item
    11): it must stay in milliseconds, a 5 MB body of junk included (bodies past
    hook_config.max_request_bytes never reach it). Issue 18's target: <= 0.3 ms per
    request with vectors packed ({"b64": ...}, what graphtap.client sends); JSON float
    lists are validated element by element."""
    import base64
    import json

    import numpy as np

    from graphtap.spec import ModelShape, normalise, parse_spec

    shape = ModelShape(num_layers=4, hidden_size=4096, max_model_len=4096, max_steers=8,
                       max_vectors=64, configured_sites={"blocks.1.hook_resid_post"},
                       num_heads=32, num_kv_heads=8)
    length, count = (400_000, 1) if spec.startswith("junk") else \
        (4096, int(spec.split("-")[1].split("x")[0]))
    values = np.random.default_rng(0).normal(size=(count, length)).astype("<f4")
    vectors = [{"b64": base64.b64encode(v.tobytes()).decode()} for v in values] \
        if spec.startswith("packed") else [[0.123456789] * length] * count
    raw = json.loads(json.dumps({"steer": [{"site": "blocks.1.hook_resid_post", "op": "add",
                                            "vector": v} for v in vectors]}))

    def admit():
        try:
            return normalise(parse_spec(raw), shape)
        except ValueError as e:
            return e

    out = benchmark(admit)
    assert isinstance(out, ValueError) == spec.startswith("junk")


@pytest.mark.parametrize("reqs", [16, 64])
def test_probe_guard_step(benchmark, reqs):
    """A probe guard's per-step host work in the worker: one decode step of `reqs`
    guarded requests, one probe row each, none finishing (courier/held.py: the rows are
    held, and go home once per request at a step that may finish it). On the H200 the
    per-step chunks this replaced (the split, a verdict per request, three tensors each
    serialised and decoded) cost +10 to +20 % TPOT at 8 and 16 req/s (benchmarks/results)."""
    from graphtap.courier import StepSnapshots
    from graphtap.courier.held import Ending, HeldRows, StepBatch
    from graphtap.spec.entries import GuardEntry

    name = "probe:blocks.16.hook_resid_post"
    guard = GuardEntry(kind="probe", threshold=1e30, stop=True, sources=(name,))
    held = HeldRows({1: name})
    ids = [f"r{i}" for i in range(reqs)]
    for r in ids:
        held.add_request(r, {1: 1}, Ending(frozenset({2}), cap=1 << 30, every_step=False))
    batch = StepBatch(ids, np.arange(reqs) + 300)
    output = SimpleNamespace(req_ids=ids, sampled_token_ids=[[5]] * reqs)
    guards = {r: (guard, 256) for r in ids}

    def step():
        labels = torch.tensor([(i, 1, 300) for i in range(reqs)])
        count = torch.cat([torch.tensor([reqs]), torch.ones(reqs, dtype=torch.long)])
        part = CaptureStep(StepRows(torch.randn(reqs, 1), labels, count, dict(enumerate(ids)),
                                    {i: {1: RowFormat(torch.float32, 1, None, 0)}
                                     for i in range(reqs)}, {1: name}, 1 << 12,
                                    OverflowKind.PROBE_ROWS))
        part.held = held
        return (StepSnapshots([part], guards, batch), output), {}

    out = benchmark.pedantic(lambda snap, o: snap.per_request(o), setup=step, rounds=200)
    assert out == {}


def _ring_probe_family():
    """CPU engine tables and a probe family with one probe at blocks.16 on every
    generated position, in a ring of 256: the spec its requests add."""
    from graphtap.engine.families.probe import ProbeFamily
    from graphtap.spec.entries import ProbeEntry

    sites = SiteTable(expand_patterns(["blocks.16.hook_resid_post"], 32))
    et = allocate(Sizes(max_reqs=R, max_tokens=512, max_len=L, num_sites=1, hidden=H,
                        steer_width=H, dtype=torch.float32, max_steers=E, max_vectors=V,
                        max_captures=4, capture_rows=16, capture_width=H, pattern_rows=16,
                        num_heads=32, patterns=False, max_probes=1, probe_width=1,
                        probe_rows=256, probe_ring=256), TORCH, torch.device("cpu"))
    fam = ProbeFamily(et.ops.probe, et.probe, et.slots, backend=TORCH, sites=sites,
                      max_len=L, model_dtype=torch.float32, bank=VectorBank(et.ops.steer))
    weights = np.ones(H, np.float32).tobytes()
    spec = NormalisedSpec(probe=(ProbeEntry(16, "resid_post", "probe:blocks.16.hook_resid_post",
                                            (weights,), ("w",), (0.0,), False, "generated"),))
    return et, fam, spec


@pytest.mark.parametrize("reqs", [16, 64])
def test_probe_ring_decode_step(benchmark, reqs):
    """A probe's per-step host work in the worker while `reqs` probed requests decode
    with the ring (engine/ring.py): the plan finds a ring step (no
    routing, no rows), the step set asks whether any request may finish (none does).
    Compare test_probe_guard_step: the held rows of one step (routed, cloned, copied)."""
    from graphtap.courier import StepSnapshots
    from graphtap.courier.held import Ending, StepBatch
    from graphtap.engine.families.probe import RING_STEP

    et, fam, spec = _ring_probe_family()
    ids = [f"r{i}" for i in range(reqs)]
    for i, r in enumerate(ids):
        fam.add_request(i, r, 256, spec)
        fam.hold(r, Ending(frozenset({2}), cap=1 << 30, every_step=False))
    et.slots.apply()
    computed = np.arange(reqs) + 300
    batch = SimpleNamespace(req_ids=ids, num_reqs=reqs, num_tokens=reqs,
                            num_tokens_after_padding=reqs, idx_mapping_np=np.arange(reqs),
                            num_computed_tokens_np=computed,
                            num_scheduled_tokens=np.ones(reqs, np.int32))
    output = SimpleNamespace(req_ids=ids, sampled_token_ids=[[5]] * reqs)
    router = None

    def step():
        plan = fam.plan(batch)
        assert plan is RING_STEP
        fam.route(batch, router, plan)
        part = fam.snapshot()
        return StepSnapshots([part], None, StepBatch.of(batch)).per_request(output)

    assert benchmark(step) == {}


@pytest.mark.parametrize("reqs", [16, 64])
def test_probe_ring_finish_step(benchmark, reqs):
    """The step at which `reqs` probed requests all reach their length cap (a batch
    admitted at once finishes at once): each request's ring is read (127 generated
    positions), joined to its held rows and flushed home. On a GPU the reads also wait
    for their copies: one wait per fetch of up to 64 slots (engine/ring.py)."""
    from graphtap.courier import StepSnapshots
    from graphtap.courier.chunks import ERROR
    from graphtap.courier.held import Ending, StepBatch

    et, fam, spec = _ring_probe_family()
    ids = [f"r{i}" for i in range(reqs)]
    prompt, out = 256, 128
    computed = np.full(reqs, prompt + out - 1)  # this step runs position prompt + out - 1
    written = np.arange(prompt, prompt + out)  # the op wrote the ring through that one
    batch = SimpleNamespace(req_ids=ids, num_reqs=reqs, num_tokens=reqs,
                            num_tokens_after_padding=reqs, idx_mapping_np=np.arange(reqs),
                            num_computed_tokens_np=computed,
                            num_scheduled_tokens=np.ones(reqs, np.int32))
    output = SimpleNamespace(req_ids=ids, sampled_token_ids=[[5]] * reqs)

    def admitted():
        for i, r in enumerate(ids):
            fam.add_request(i, r, prompt, spec)
            fam.hold(r, Ending(frozenset({2}), cap=prompt + out, every_step=False))
            et.ops.probe.ring_pos[i, 0, written % 256] = torch.from_numpy(written).int()
        et.slots.apply()
        fam.plan(batch)
        fam.route(batch, None, fam.plan(batch))
        return (StepSnapshots([fam.snapshot()], None, StepBatch.of(batch)), output), {}

    got = benchmark.pedantic(lambda snap, o: snap.per_request(o), setup=admitted, rounds=50)
    assert len(got) == reqs
    got = {r: open_payload(p) for r, p in got.items()}  # as the frontend reads them
    assert all(ERROR not in c and len(c["probe:blocks.16.hook_resid_post"]) == out
               for c in got.values())


@pytest.mark.parametrize("fresh", [True, False], ids=["new-vector", "resident-vector"])
def test_admission_tables(benchmark, fresh):
    """The worker's half of admission (issue 18: <= 0.3 ms a request with the spec's
    half, test_spec_validation): a request that steers one site with a 4096-float vector
    and captures another is written into the tables (the vector into the resident bank
    when new, its slot's entries, the staged writes applied) and removed again."""
    sites = SiteTable(expand_patterns(["blocks.*.hook_resid_post"], 32))
    width = 4096
    et = allocate(Sizes(max_reqs=R, max_tokens=512, max_len=L, num_sites=len(sites),
                        hidden=width, steer_width=width, dtype=torch.float32, max_steers=E,
                        max_vectors=V, max_captures=4, capture_rows=64, capture_width=width,
                        pattern_rows=16, num_heads=32, patterns=False), TORCH,
                  torch.device("cpu"))
    steer = SteerFamily(et, sites, VectorBank(et.ops.steer))
    cap = CaptureFamily(et.ops.capture, et.capture, et.slots,
                        widths={"resid_post": (width, 0)}, backend=TORCH, sites=sites,
                        max_len=L, model_dtype=torch.float32)
    rng = np.random.default_rng(0)
    vectors = iter([rng.normal(size=width).astype(np.float32).tobytes() for _ in range(4000)])
    fixed = next(vectors)

    def spec():
        vec = next(vectors) if fresh else fixed
        return NormalisedSpec(
            steer=(SteerEntry(3, "resid_post", vec, str(hash(vec)), 1.0, -np.inf, np.inf,
                              "all"),),
            capture=(CaptureEntry(5, "resid_post", "blocks.5.hook_resid_post", "float32",
                                  None, "last_prompt"),)), {}

    def admit(s):
        steer.add_request(7, "r", 200, s)
        cap.add_request(7, "r", 200, s)
        et.slots.apply()
        steer.apply_staged_writes()
        steer.remove_request("r")
        cap.remove_request("r")

    benchmark.pedantic(lambda s: admit(s), setup=lambda: ((spec()[0],), {}), rounds=300)


@pytest.mark.parametrize("max_len", [2048, 131072])
def test_admission_by_max_len(benchmark, max_len):
    """The worker's half of a capture request's admission (3 last-prompt sites, written
    and removed again) at a short and a long model length: position rules go through
    runs, not masks over max_model_len, so a 128k-token model admits like a 2k one but
    for the slot row's wider bitmap."""
    sites = SiteTable(expand_patterns(["blocks.*.hook_resid_post"], 32))
    et = allocate(Sizes(max_reqs=R, max_tokens=512, max_len=max_len, num_sites=len(sites),
                        hidden=H, steer_width=H, dtype=torch.float32, max_steers=E,
                        max_vectors=V, max_captures=4, capture_rows=64, capture_width=H,
                        pattern_rows=16, num_heads=32, patterns=False), TORCH,
                  torch.device("cpu"))
    cap = CaptureFamily(et.ops.capture, et.capture, et.slots, widths={"resid_post": (H, 0)},
                        backend=TORCH, sites=sites, max_len=max_len,
                        model_dtype=torch.float32)
    spec = NormalisedSpec(capture=tuple(
        CaptureEntry(layer, "resid_post", f"blocks.{layer}.hook_resid_post", "float32", None,
                     "last_prompt") for layer in (8, 16, 24)))

    def admit():
        cap.add_request(7, "r", 1000, spec)
        et.slots.apply()
        cap.remove_request("r")

    benchmark(admit)
