"""Attention patterns without an engine: the op on a paged cache (torch reference, Triton
kernel in Triton's interpreter, a dense softmax), both cache layouts, GQA, and the
pattern family's device-side routing and per-request step split."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from graphtap.courier.patterns import unpack_patterns
from graphtap.engine.families.pattern import PatternFamily
from graphtap.ops.backend import TORCH
from graphtap.ops.pattern import key_cache_view, pattern_reference
from graphtap.ops.tables import KeyCache, Label
from graphtap.spec import NormalisedSpec, PatternEntry
from graphtap.spec.sites import Site, SiteTable
from helpers import engine_tables

HQ, HKV, D, BS, NB, L, P = 4, 2, 64, 32, 12, 160, 40


def paged(backend, seed=0):
    """A paged cache in the backend's layout, with the dense keys it holds per request."""
    g = torch.Generator().manual_seed(seed)
    if backend == "CPU_ATTN:vec":
        kv = torch.randn(NB, HKV, BS, 2 * D, generator=g)
    else:  # logical [blocks, kv_heads, block_size, 2D] over a [blocks, block_size, ...] buffer
        kv = torch.randn(NB, BS, HKV, 2 * D, generator=g).transpose(1, 2)
    keys = key_cache_view(kv, backend, D)
    table = torch.zeros(3, 8, dtype=torch.int32)
    table[0, :3] = torch.tensor([5, 2, 9])
    table[1, :2] = torch.tensor([0, 11])
    table[2, :4] = torch.tensor([7, 1, 3, 4])
    return keys, table


def dense_keys(keys, table, brow, n):
    j = torch.arange(n)
    return keys[table[brow, j // BS].long(), j % BS]  # [n, kv_heads, D]


def route_rows(t, rows):
    """Label buffer rows by hand: (site, token, head, batch row, position, slot) each."""
    t.labels[:, Label.SITE] = -1
    for i, (site, tok, head, brow, pos, slot) in enumerate(rows):
        for col, v in ((Label.SITE, site), (Label.TOKEN, tok), (Label.HEAD, head),
                       (Label.BATCH_ROW, brow), (Label.POSITION, pos), (Label.SLOT, slot)):
            t.labels[i, col] = v


def pattern_tables():
    return engine_tables(max_reqs=3, max_captures=2, num_heads=HQ, pattern_rows=P,
                         max_len=L).ops.pattern


@pytest.mark.parametrize("backend", ["CPU_ATTN:vec", "FLASH_ATTN"])
def test_reference_and_triton_match_dense_softmax(backend):
    from graphtap.ops.pattern_triton import pattern_triton  # Triton's interpreter here

    keys, table = paged(backend)
    t = pattern_tables()
    q = torch.randn(10, HQ, D, generator=torch.Generator().manual_seed(3))
    kc = KeyCache(keys, table, 0.125, HQ // HKV)
    # site, token, head, batch row, position, slot; site 2 rows belong to another op call
    rows = [(1, 0, 0, 0, 0, 5), (1, 3, 3, 0, 70, 5), (1, 4, 1, 1, 40, 2),
            (1, 9, 2, 2, 127, 0), (2, 5, 0, 1, 12, 2), (1, 6, 2, 2, 31, 0)]
    route_rows(t, rows)
    ref = t.buf.clone()
    pattern_reference(t, q, kc, 1)
    ref, t.buf[:] = t.buf.clone(), 0
    pattern_triton(t, q, kc, 1)
    for i, (site, tok, head, brow, pos, _) in enumerate(rows):
        if site != 1:
            assert ref[i].abs().sum() == 0 and t.buf[i].abs().sum() == 0
            continue
        k = dense_keys(keys, table, brow, pos + 1)[:, head // (HQ // HKV)]
        want = torch.softmax(k @ q[tok, head] * 0.125, dim=0)
        torch.testing.assert_close(ref[i, : pos + 1], want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(t.buf[i, : pos + 1], want, atol=1e-6, rtol=1e-5)


def test_cpu_vec_layout_is_transposed_keys_then_values():
    # What cpu_attn_reshape_and_cache writes (measured in an engine): per block and KV
    # head, K[d, t] at d * block_size + t, then V.
    kv = torch.arange(NB * HKV * BS * 2 * D, dtype=torch.float32).view(NB, HKV, BS, 2 * D)
    keys = key_cache_view(kv, "CPU_ATTN:vec", D)
    assert keys.shape == (NB, BS, HKV, D)
    base = lambda b, h: (b * HKV + h) * BS * 2 * D  # noqa: E731
    assert keys[3, 5, 1, 7] == base(3, 1) + 7 * BS + 5


def test_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="attn.hook_pattern does not support the XFORMERS"):
        key_cache_view(torch.zeros(2, 2, 32, 128), "XFORMERS", 64)


def family():
    sites = SiteTable([Site(0, "resid_pre"), Site(1, "attn_pattern"), Site(2, "attn_pattern")])
    et = engine_tables(max_reqs=3, max_captures=2, num_heads=HQ, pattern_rows=P, max_len=L,
                       num_sites=len(sites), max_tokens=32)
    f = PatternFamily(et.ops.pattern, et.pattern, et.slots, key_caches={}, backend=TORCH,
                      sites=sites, max_len=L, model_dtype=torch.float32)
    return f, et


def spec(*entries):
    return NormalisedSpec(pattern=tuple(entries))


def entry(layer, heads=tuple(range(HQ)), positions="all", dtype="float32"):
    return PatternEntry(layer, f"blocks.{layer}.attn.hook_pattern", dtype, tuple(heads),
                        positions)


def router(slots, rows):
    """The token router's part the family uses: its map, and the row routing from it
    (the torch reference, as on CPU)."""
    from graphtap.ops.route import route_rows_reference

    def route_rows(t, batch, max_len):
        n = batch.num_tokens_after_padding
        route_rows_reference(t, slots[:n], rows[:n], batch.positions[:n], max_len)
    return SimpleNamespace(tok_slot=slots, tok_row=rows, route_rows=route_rows)


@pytest.mark.parametrize("home", [True, False], ids=["copied-home", "cloned"])
def test_routing_labels_every_row_and_snapshot_splits_per_request(home):
    """`home`: the step's rows are host copies made in the snapshot (a small step), or
    device clones copied home later (RowFamily.snapshot's two ways); either way the
    snapshot holds the step's values whatever the next step writes to the buffers."""
    f, et = family()
    if not home:
        f.home_bytes = 0
    t = et.ops.pattern
    f.add_request(0, "a", 5, spec(entry(1, [1, 3])))
    f.add_request(2, "b", 3, spec(entry(2, positions="last_prompt"), entry(1, [0])))
    f.add_request(1, "c", 4, spec())
    et.slots.apply()
    # Batch: a prefill of 5 (slot 0), c decode (slot 1), b prefill of 3 (slot 2), padding.
    slots = torch.tensor([0] * 5 + [1] + [2] * 3 + [3, 3])
    rows = torch.tensor([0] * 5 + [1] + [2] * 3 + [0, 0])
    batch = SimpleNamespace(req_ids=["a", "c", "b"], num_tokens_after_padding=11,
                            positions=torch.tensor([0, 1, 2, 3, 4, 9, 0, 1, 2, 0, 0]),
                            num_scheduled_tokens=np.array([5, 1, 3]))
    plan = f.plan(batch)
    f.route(batch, router(slots, rows), plan)
    assert int(t.count[0]) == 5 * 2 + 1 * 4 + 3 * 1
    # Fill each routed row with a recognisable value: token*100 + head, over its keys.
    for i in range(int(t.count[0])):
        tok, head, pos = (int(t.labels[i, c]) for c in (Label.TOKEN, Label.HEAD, Label.POSITION))
        t.buf[i, : pos + 1] = tok * 100 + head
    snap = f.snapshot()
    assert snap.home is home
    t.buf.fill_(-1.0), t.labels.fill_(0), t.count.zero_()  # the next step's writes
    snap.to_cpu_nonblocking()
    out = snap.per_request()
    unpacked = {req: {k[:-len("@ragged")]: unpack_patterns(v, tensors[
        k.replace("@ragged", "@positions")]) for k, v in tensors.items() if k.endswith("@ragged")}
        for req, tensors in out.items()}
    assert set(out) == {"a", "b"}
    a = unpacked["a"]["blocks.1.attn.hook_pattern"]
    assert a.shape == (5, 2, 5) and out["a"]["blocks.1.attn.hook_pattern@positions"].tolist() \
        == [0, 1, 2, 3, 4]
    assert a[3, 1, :4].tolist() == [303.0] * 4 and a[3, 1, 4] == 0  # causal zeros
    b2 = unpacked["b"]["blocks.2.attn.hook_pattern"]
    assert b2.shape == (1, HQ, 3) and b2[0, :, 0].tolist() == [800, 801, 802, 803]
    b1 = unpacked["b"]["blocks.1.attn.hook_pattern"]
    assert b1.shape == (3, 1, 3) and b1[:, 0, 0].tolist() == [600, 700, 800]
    # A step without pattern requests leaves every row idle.
    assert not f.plan(SimpleNamespace(req_ids=["c"]))
    f.deactivate()
    assert (t.labels[:, Label.SITE] == -1).all() and f.snapshot() is None


@pytest.mark.parametrize("home", [True, False], ids=["copied-home", "cloned"])
def test_count_and_labels_go_home_in_one_copy(home):
    """A row family's count and labels are one device block (RowTables.head, the
    count first): a step's count and used labels go home as one copy of its start,
    in both of the snapshot's ways, and hold the values the step wrote."""
    f, et = family()
    if not home:
        f.home_bytes = 0
    t = et.ops.pattern
    assert t.count.untyped_storage().data_ptr() == t.labels.untyped_storage().data_ptr()
    assert t.labels.data_ptr() - t.count.data_ptr() == t.labels_at * 8 and \
        t.labels.data_ptr() % 16 == 0
    f.add_request(0, "a", 5, spec(entry(1, [1, 3])))
    et.slots.apply()
    batch = SimpleNamespace(req_ids=["a"], num_tokens_after_padding=5,
                            positions=torch.arange(5), num_scheduled_tokens=np.array([5]))
    f.route(batch, router(torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long)),
            f.plan(batch))
    used = int(t.count[0])
    count, labels = t.count.clone(), t.labels[:used, :f.host_labels].clone()
    snap = f.snapshot()
    assert (snap._head is None) is home  # copied home already, or one block to copy
    t.labels.fill_(7), t.count.fill_(7)  # the next step's writes
    snap.to_cpu_nonblocking()
    assert snap.count.untyped_storage().data_ptr() == snap.labels.untyped_storage().data_ptr()
    assert torch.equal(snap.count, count) and torch.equal(snap.labels[:used], labels)
    assert snap.per_request()["a"]


def test_overflow_is_reported_not_dropped():
    from graphtap.courier import Overflow, OverflowKind

    f, et = family()
    f.add_request(0, "a", 30, spec(entry(1, dtype="model")))
    et.slots.apply()
    batch = SimpleNamespace(req_ids=["a"], num_tokens_after_padding=30,
                            positions=torch.arange(30), num_scheduled_tokens=np.array([30]))
    f.route(batch, router(torch.zeros(30, dtype=torch.long), torch.zeros(30, dtype=torch.long)),
            f.plan(batch))
    flag = f.snapshot().per_request()["a"]["graphtap:overflow"]
    assert Overflow.from_tensor(flag) == Overflow(OverflowKind.PATTERN_ROWS, 30 * HQ, P)


def test_steps_that_capture_nothing_route_nothing():
    """Host-side skip: a request wanting only its last prompt position costs no device
    work while it decodes; a chunk that holds the position, or no host view, routes. The
    row bound counts wanted positions in the step's window, per rule and entry."""
    from graphtap.engine.wanted import Wants, positions_end, rows_in_step

    probe, full = Wants(L), Wants(L)
    probe.add("last_prompt", 10, 3)  # e.g. three residual sites at the last prompt token
    full.add("all", 10, 1)
    full.add("prompt", 10, 2)  # e.g. k of two heads... as rows per token
    wants = {"probe": probe, "all": full}
    assert (probe.end, full.end) == (10, L)  # decoding past the probe: no mask scans
    step = lambda computed, scheduled, drafts=None: SimpleNamespace(  # noqa: E731
        req_ids=["probe", "all", "plain"], num_computed_tokens_np=np.array(computed),
        num_scheduled_tokens=np.array(scheduled), num_draft_tokens_per_req=drafts)
    assert rows_in_step(wants, step([0, 0, 0], [6, 6, 6])) == [(1, "all", 6 + 12)]
    assert rows_in_step(wants, step([6, 6, 6], [4, 4, 4])) == \
        [(0, "probe", 3), (1, "all", 4 + 8)]
    assert rows_in_step(wants, step([12, 12, 12], [1, 1, 1])) == [(1, "all", 1)]  # decode
    # Spec decode: the host count may run ahead by rejected drafts; the window widens,
    # and the bound never exceeds the tokens in the step.
    assert rows_in_step(wants, step([11, 11, 11], [3, 3, 3], np.array([2, 2, 0]))) == \
        [(0, "probe", 3), (1, "all", 3 + 2)]
    no_view = SimpleNamespace(req_ids=["probe"], num_scheduled_tokens=np.array([5]))
    assert rows_in_step(wants, no_view) == [(0, "probe", 3)]
    # Pattern snapshots copy key columns up to the batch's last position (drafts included).
    batch = step([11, 11, 11], [3, 3, 3], np.array([2, 2, 0]))
    batch.num_reqs = 3
    assert positions_end(batch, L) == 14 and positions_end(no_view, L) == L


def test_the_want_table_matches_the_loop():
    """Random batches: the table (one numpy pass per step, or plain Python for a few
    requests of few runs, among them a large batch's few rows before their last wanted
    position) gives each batch row the bound the per-request loop does, and their
    total; both of its paths are taken and agree."""
    from graphtap.engine.wanted import WantTable, Wants, rows_in_step

    rng = np.random.default_rng(0)
    # the last rule has more runs than the plain-Python path takes (PLAIN_RUNS)
    rules = ["last_prompt", "prompt", "all", "generated", [3, 7], {"start": 2, "end": 9},
             list(range(1, 40, 2))]
    paths = {"plain": 0, "numpy": 0, "plain_large": 0}
    for _ in range(800):
        n = int(rng.integers(1, 12)) if rng.random() < 0.6 else int(rng.integers(17, 40))
        slots = rng.permutation(48)[:n]
        wants = {}
        for i, slot in enumerate(slots):
            if rng.random() < 0.3:
                continue  # a request without entries
            w = Wants(L)
            for _ in range(int(rng.integers(1, 3))):
                w.add(rules[int(rng.integers(len(rules)))], int(rng.integers(1, 20)),
                      int(rng.integers(1, 4)))
            wants[f"r{i}"] = w
        batch = SimpleNamespace(
            req_ids=[f"r{i}" for i in range(n)], idx_mapping_np=slots,
            num_computed_tokens_np=rng.integers(0, L, n),
            num_scheduled_tokens=rng.integers(1, 8, n),
            num_draft_tokens_per_req=rng.integers(0, 3, n) if rng.random() < 0.5 else None)
        table = WantTable(L)
        for i, slot in enumerate(slots):
            if f"r{i}" in wants:
                table.set(int(slot), wants[f"r{i}"])
        table.set(48, wants.get("r0", Wants(L)))  # a live request not in this batch
        if rng.random() < 0.2:
            table.drop(int(slots[0]))  # gone from the table: it wants nothing
            wants.pop("r0", None)
        loop = rows_in_step(wants, batch)
        assert table.bound(batch) == sum(r for _, _, r in loop)
        per_row = np.zeros(n, np.int64)
        for i, _, r in loop:
            per_row[i] = r
        assert table.rows(batch).tolist() == per_row.tolist()
        small = table._small_rows(batch)  # the plain-Python path, where it applies
        paths["numpy" if small is None else "plain_large" if n > 16 else "plain"] += 1
        if small is not None:
            assert small == per_row.tolist()
            table._plain.clear()  # the numpy pass alone gives the same
            assert table.rows(batch).tolist() == per_row.tolist()
    assert min(paths.values()) > 50, paths


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """The same (token, head, position) row, alone in its step or beside rows of longer
    reach, gets the same bits: the reference once sized every row's softmax by the
    step's longest row, and a served request's pattern then differed, in the last bits,
    from its solo run."""
    keys, table = paged("CPU_ATTN:vec")
    kc = KeyCache(keys, table, 0.125, HQ // HKV)
    q = torch.randn(10, HQ, D, generator=torch.Generator().manual_seed(5))
    alone, crowded = pattern_tables(), pattern_tables()
    route_rows(alone, [(1, 4, 1, 1, 40, 2)])
    route_rows(crowded, [(1, 9, 2, 2, 127, 0), (1, 4, 1, 1, 40, 2), (1, 3, 3, 0, 70, 5)])
    pattern_reference(alone, q, kc, 1)
    pattern_reference(crowded, q, kc, 1)
    assert torch.equal(alone.buf[0], crowded.buf[1])


@pytest.mark.parametrize("backend", ["CPU_ATTN:vec", "FLASH_ATTN"])
def test_attention_mass_matches_span_sums_of_the_dense_softmax(backend):
    """The mass op (torch reference and Triton kernel) sums each entry's key spans of the
    same probabilities the pattern op stores; unused spans and spans past the query are
    exactly zero; rows of other sites are left alone."""
    from graphtap.ops.mass import mass_reference
    from graphtap.ops.mass_triton import mass_triton

    keys, table = paged(backend)
    q = torch.randn(10, HQ, D, generator=torch.Generator().manual_seed(5))
    kc = KeyCache(keys, table, 0.125, HQ // HKV)
    spans = {0: [(0, 1), (2, 30), (60, 160)], 2: [(5, 6), (0, 200)], 1: [(100, 110)]}

    def tables():
        t = engine_tables(max_reqs=3, max_captures=2, num_heads=HQ, pattern_rows=P,
                          max_len=L, max_spans=3, mass_rows=8).ops.mass
        for slot, sp in spans.items():
            t.entry_site[slot, 1] = 1  # the entry at site 1 is each slot's second
            t.entry_spans[slot, 1, :len(sp)] = torch.tensor(sp, dtype=torch.int32)
        t.entry_site[2, 0] = 2  # another site's entry comes first in slot 2
        t.entry_spans[2, 0, 0] = torch.tensor([0, 160], dtype=torch.int32)
        return t
    rows = [(1, 0, 0, 0, 0, 1), (1, 3, 3, 0, 70, 0), (1, 4, 1, 1, 40, 2),
            (1, 9, 2, 2, 127, 0), (2, 5, 0, 1, 12, 2), (1, 6, 2, 2, 31, 1)]
    out = []
    for op in (mass_reference, mass_triton):
        t = tables()
        route_rows(t, rows)
        op(t, q, kc, 1)
        out.append(t.buf.clone())
    for i, (site, tok, head, brow, pos, slot) in enumerate(rows):
        if site != 1:
            assert out[0][i].abs().sum() == 0 and out[1][i].abs().sum() == 0
            continue
        k = dense_keys(keys, table, brow, pos + 1)[:, head // (HQ // HKV)]
        p = torch.softmax(k @ q[tok, head] * 0.125, dim=0)
        want = torch.zeros(3)
        for s, (lo, hi) in enumerate(spans[slot]):
            want[s] = p[lo:min(hi, pos + 1)].sum() if lo <= pos else 0.0
        for got in out:
            torch.testing.assert_close(got[i], want, atol=1e-6, rtol=1e-5)
            if len(spans[slot]) < 3:
                assert got[i, len(spans[slot]):].abs().sum() == 0


@pytest.mark.parametrize("entry, field, words", [
    ({"site": "blocks.1.attn.hook_q", "spans": [{"start": 0, "end": 2}]},
     "hooks.attention_mass[0].site", "hook_pattern sites"),
    ({"site": "blocks.1.attn.hook_pattern", "spans": []}, "hooks.attention_mass[0].spans",
     "at least 1"),
    ({"site": "blocks.1.attn.hook_pattern", "spans": [{"start": 3, "end": 2}]},
     "hooks.attention_mass[0].spans[0]", "greater than start"),
    ({"site": "blocks.1.attn.hook_pattern", "spans": [{"start": 0, "end": 2}] * 4},
     "hooks.attention_mass[0].spans", "max_spans"),
    ({"site": "blocks.1.attn.hook_pattern", "spans": [{"start": 99, "end": 120}]},
     "hooks.attention_mass[0].spans[0].start", "beyond max_model_len"),
    ({"site": "blocks.1.attn.hook_pattern", "spans": [{"start": 0, "end": 2}], "heads": [4]},
     "hooks.attention_mass[0].heads", "out of range"),
])
def test_invalid_attention_mass_names_the_field(entry, field, words):
    from graphtap.spec import ModelShape, normalise, parse_spec

    shape = ModelShape(num_layers=2, hidden_size=16, max_model_len=64, max_steers=1,
                       max_vectors=1, num_heads=HQ, num_kv_heads=HKV, head_dim=4, max_spans=3,
                       configured_sites={"blocks.1.attn.hook_q", "blocks.1.attn.hook_pattern"})
    with pytest.raises(ValueError) as e:
        normalise(parse_spec({"attention_mass": [entry]}), shape)
    assert str(e.value).startswith(field) and words in str(e.value), str(e.value)


def test_attention_mass_entry():
    from graphtap.spec import ModelShape, normalise, parse_spec

    shape = ModelShape(num_layers=2, hidden_size=16, max_model_len=64, max_steers=1,
                       max_vectors=1, num_heads=HQ, num_kv_heads=HKV, head_dim=4,
                       configured_sites={"blocks.1.attn.hook_pattern"})
    spec = normalise(parse_spec({"attention_mass": [{
        "site": "blocks.1.attn.hook_pattern", "heads": [3, 1],
        "spans": [{"start": 0, "end": 4}, {"start": 10, "end": 500}]}]}), shape)
    (m,) = spec.mass
    assert m.name == "mass:blocks.1.attn.hook_pattern" and m.heads == (1, 3)
    assert [(s.start, s.end) for s in m.spans] == [(0, 4), (10, 64)]
    assert m.positions == "last_prompt" and spec.captures_anything


def test_a_single_qk_prefill_goes_home_on_the_main_stream():
    """A burst's first qk step (one request: q at its last prompt token and k at each of
    256, 4 layers x 4 of 8 kv heads of 128, Llama-3-8B: 1028 rows of 512 bf16 columns,
    just over 1 MiB) is copied home in the snapshot (two host copies), not cloned and
    copied home later (two clones, then two copies on two streams and an event): every
    other request of the burst waits behind that step's host calls. A step of two such
    requests still goes the clone way."""
    from graphtap.engine.families.capture import CaptureFamily
    from graphtap.ops.route import route_rows_reference
    from graphtap.spec import CaptureEntry
    from graphtap.spec.sites import SiteTable, expand_patterns

    sites = SiteTable(expand_patterns(["blocks.*.attn.hook_q", "blocks.*.attn.hook_k"], 32))
    et = engine_tables(max_reqs=4, max_tokens=512, max_len=512, num_sites=len(sites),
                       hidden=4096, dtype=torch.bfloat16, max_captures=8,
                       capture_rows=4096, capture_width=4096, patterns=False)
    f = CaptureFamily(et.ops.capture, et.capture, et.slots,
                      widths={"attn_q": (4096, 128), "attn_k": (1024, 128)}, backend=TORCH,
                      sites=sites, max_len=512, model_dtype=torch.bfloat16)
    heads = (0, 1, 2, 3)
    qk = NormalisedSpec(capture=tuple(e for layer in (4, 8, 16, 24) for e in (
        CaptureEntry(layer, "attn_q", f"blocks.{layer}.attn.hook_q", "model", heads,
                     "last_prompt"),
        CaptureEntry(layer, "attn_k", f"blocks.{layer}.attn.hook_k", "model", heads,
                     "prompt"))))
    for reqs, home in ((1, True), (2, False)):
        for r in range(reqs):
            f.add_request(r, f"r{r}", 256, qk)
        et.slots.apply()
        n = 256 * reqs
        slots = torch.arange(n) // 256
        batch = SimpleNamespace(req_ids=[f"r{r}" for r in range(reqs)],
                                num_tokens_after_padding=n, positions=torch.arange(n) % 256,
                                num_scheduled_tokens=np.full(reqs, 256))

        def route_rows(t, b, max_len, slots=slots, n=n, batch=batch):
            route_rows_reference(t, slots, slots, batch.positions, max_len)
        f.route(batch, SimpleNamespace(route_rows=route_rows), f.plan(batch))
        snap = f.snapshot()
        assert snap.rows.shape == (1028 * reqs, 512) and snap.home is home, reqs
        for r in range(reqs):
            f.remove_request(f"r{r}")
