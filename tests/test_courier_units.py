"""The courier's host side, without an engine: what the output path does to captures."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphtap.courier import CaptureStep, RowFormat, StepRows
from graphtap.courier.chunks import OVERFLOW, OverflowKind
from graphtap.courier.pack import unpack
from graphtap.courier.payload import seal
from graphtap.frontend import GraphtapFrontend
from graphtap.outputs import HookOutputs
from graphtap.spec import ModelShape

SHAPE = ModelShape(num_layers=4, hidden_size=8, max_model_len=64,
                   configured_sites={"blocks.1.hook_resid_post"}, max_steers=2, max_vectors=4,
                   max_captures=2, num_heads=2, num_kv_heads=2, save_root=None)
SITE = "blocks.1.hook_resid_post"


def step(rows, labels, count, slot_to_req, formats, names, capacity=100):
    """A capture step as the capture family hands it to the courier: rows written, then
    per request slot the units it wanted (here: its labelled rows)."""
    wanted = torch.bincount(labels[:count, 0], minlength=max(slot_to_req) + 2)
    return CaptureStep(StepRows(rows, labels, torch.cat([torch.tensor([count]), wanted]),
                                slot_to_req, formats, names, capacity,
                                OverflowKind.CAPTURE_ROWS))


def finished(rows, pos):
    return GraphtapFrontend(SHAPE).finish_outputs(
        "r", [seal({SITE: rows[:2], f"{SITE}@positions": pos[:2]}),
              seal({SITE: rows[2:], f"{SITE}@positions": pos[2:]})])


def test_rows_in_position_order_and_the_last_repeat_wins():
    rows = torch.arange(5.0)[:, None].expand(5, 8)
    out = finished(rows, torch.tensor([0, 1, 2, 3, 4]))  # the usual case: in order
    assert out.positions[SITE].tolist() == [0, 1, 2, 3, 4] and out[SITE][:, 0].tolist() == \
        [0, 1, 2, 3, 4]
    # Recomputed after preemption: positions 1 and 2 ran twice; the later rows win.
    out = finished(rows, torch.tensor([1, 2, 0, 1, 2]))
    assert out.positions[SITE].tolist() == [0, 1, 2] and out[SITE][:, 0].tolist() == [2, 3, 4]


def test_merged_request_outputs_keep_the_hooks():
    """AsyncLLM merges outputs the consumer has not read (RequestOutput.add); the hooks
    ride on the finished one and must survive the merge (patch 0009)."""
    from vllm.outputs import CompletionOutput, RequestOutput

    def output(n, hooks, finished):
        done = CompletionOutput(0, "", list(range(n)), None, None)
        return RequestOutput("r", None, [1, 2], None, [done], finished, hooks=hooks)

    hooks = HookOutputs({SITE: torch.ones(3, 8)}, {SITE: torch.arange(3)})
    first = output(1, None, False)
    first.add(output(2, hooks, True), aggregate=False)
    assert first.finished and first.hooks is hooks
    later = output(3, None, True)  # a later output without hooks keeps what came
    first.add(later, aggregate=False)
    assert first.hooks is hooks


def test_results_own_their_storage():
    """A one-chunk capture that is a view of a whole step must not keep the step alive."""
    step = torch.randn(100, 8)
    out = GraphtapFrontend(SHAPE).finish_outputs(
        "r", [seal({SITE: step[10:13], f"{SITE}@positions": torch.tensor([4, 5, 6])})])
    assert out[SITE].untyped_storage().nbytes() == 3 * 8 * 4
    torch.testing.assert_close(out[SITE], step[10:13])


# Site-major as the device writes them. Split: slot 2's site-1 rows are split by slot 0's
# and out of position order (a sort is needed); slot 7 (a request gone since) sits between
# live rows. Grouped: every (slot, site) group one run in position order, the usual step
# (no sort: the device order is used as it is).
SPLIT = [(s, 0, p) for s in (0, 7, 1, 2) for p in range(3)] + \
    [(2, 1, 5), (0, 1, 0), (0, 1, 1), (2, 1, 4), (1, 1, 7)] + \
    [(s, 2, p) for s in (1, 0) for p in (4, 5)]
GROUPED = [(s, 0, p) for s in (2, 7, 0, 1) for p in range(3)] + \
    [(2, 1, 4), (2, 1, 5), (0, 1, 0), (0, 1, 1), (1, 1, 7)] + \
    [(s, 2, p) for s in (1, 0) for p in (4, 5)]


@pytest.mark.parametrize("small_rows", [0, 1000], ids=["arrays", "plain"])
@pytest.mark.parametrize("labels", [SPLIT, GROUPED], ids=["split", "grouped"])
def test_step_split_per_request_matches_a_row_by_row_reference(labels, small_rows):
    """CaptureStep.per_request against a row-by-row reference: residual rows (full
    width), k rows of chosen heads (narrower site), v rows of every head, a float32
    request beside model-dtype ones, rows in the buffer as the device leaves them. No
    result may view the step's buffer (it would pin it)."""
    import numpy as np

    from graphtap.courier.groups import grouped_in_order

    width, hd = 16, 2  # buffer row width; attention sites: 4 heads x 2 = 8 columns
    names = {0: "blocks.0.hook_resid_post", 1: "blocks.0.attn.hook_k", 2: "blocks.1.attn.hook_v"}
    formats = {}  # as the scheduler keeps them (chosen heads a tuple)
    for slot, dtype in ((0, torch.bfloat16), (1, torch.float32), (2, torch.bfloat16)):
        formats[slot] = {0: RowFormat(dtype, width, None, 0),
                         1: RowFormat(dtype, 8, ((3, 1), (1, 2, 3), (0,))[slot], hd),  # gaps
                         2: RowFormat(dtype, 8, None, hd)}
    assert grouped_in_order(np.array(labels), (0, 1, 2)) == (labels is GROUPED)
    rows = torch.randn(len(labels) + 3, width).to(torch.bfloat16)  # + unused rows
    snap = step(rows, torch.tensor(labels + [(9, 9, 9)] * 3), len(labels),
                {0: "a", 1: "b", 2: "c", 9: "gone"}, formats, names)
    snap.small_rows = small_rows  # the array passes, or the small steps' plain Python
    out = {r: unpack(c) for r, c in snap.per_request().items()}
    assert set(out) == {"a", "b", "c"}
    for req, slot in (("a", 0), ("b", 1), ("c", 2)):
        for site, name in names.items():
            idx = sorted((p, i) for i, (s, si, p) in enumerate(labels) if s == slot and si == site)
            if not idx:
                assert name not in out[req]
                continue
            dtype, w, heads, _ = formats[slot][site]
            ref = rows[[i for _, i in idx], :w]
            if site:
                ref = ref.reshape(len(idx), -1, hd)
                ref = ref[:, list(heads)] if heads is not None else ref
            got = out[req][name]
            assert got.dtype == dtype and torch.equal(got, ref.to(dtype)), (req, name)
            assert out[req][f"{name}@positions"].tolist() == [p for p, _ in idx]
            base = rows.untyped_storage().data_ptr()
            assert not (base <= got.data_ptr() < base + rows.untyped_storage().nbytes())
    assert np.array_equal(out["c"]["blocks.0.attn.hook_k@positions"].numpy(), [4, 5])


def test_a_step_copies_home_only_the_columns_its_formats_read():
    """Rows hold every head of a site in order and span the widest configured site; a
    step whose requests read heads 0-1 of k (and head 0 of v) clones and copies home
    only those columns, and splits them as it would the whole rows."""
    from graphtap.courier import columns

    width, hd = 16, 2
    fmts = {0: {0: RowFormat(torch.float32, 8, (1, 0), hd),
                1: RowFormat(torch.float32, 8, (0,), hd)},
            1: {0: RowFormat(torch.float32, 8, (1,), hd)}}
    assert [columns(f) for fs in fmts.values() for f in fs.values()] == [4, 2, 4]
    assert columns(RowFormat(torch.float32, width, None, 0)) == width
    labels = [(0, 0, 0), (0, 0, 1), (1, 0, 3), (0, 1, 0), (0, 1, 1)]
    rows = torch.randn(len(labels), width)
    names = {0: "blocks.0.attn.hook_k", 1: "blocks.0.attn.hook_v"}

    def split(r):
        return {q: unpack(c) for q, c in step(r, torch.tensor(labels), len(labels),
                                              {0: "a", 1: "b"}, fmts, names).per_request().items()}

    whole = split(rows)
    assert torch.equal(whole["a"][names[0]], rows[:2, :4].reshape(2, 2, hd)[:, [1, 0]])
    # 4: the columns these formats read; 5: another site's width, ending mid-head
    for narrow in (split(rows[:, :4].clone()), split(rows[:, :5].clone())):
        for req in whole:
            assert whole[req].keys() == narrow[req].keys()
            for name in whole[req]:
                assert torch.equal(whole[req][name], narrow[req][name]), (req, name)


def test_head_runs_copy_adjacent_heads_as_slices_in_the_order_asked():
    from graphtap.courier.pack import head_runs

    assert head_runs((0, 1, 2, 3)) == ((0, 0, 4),)
    assert head_runs((5, 2, 3)) == ((0, 5, 1), (1, 2, 2))
    assert head_runs((3, 2)) == ((0, 3, 1), (1, 2, 1))
    assert head_runs((1, 1)) == ((0, 1, 1), (1, 1, 1))


def test_every_split_result_serialises_like_vllm_sends_it():
    """Each tensor of a step's split goes through vLLM's msgpack tensor path (the engine
    core's output thread; an error there hangs the client). A step of one row caught a
    1-element positions column with numpy's stride of 3."""
    from vllm.v1.utils import tensor_data

    for n in (1, 2, 5):
        labels = torch.tensor([(0, 0, p) for p in range(n)])
        snap = step(torch.randn(n, 8), labels, n, {0: "a"},
                    {0: {0: RowFormat(torch.float32, 8, None, 0)}}, {0: "s"})
        out = snap.per_request()["a"]
        for t in out.values():
            assert len(tensor_data(t)) == t.numel() * t.element_size()
        assert unpack(out)["s@positions"].tolist() == list(range(n))


@pytest.mark.parametrize("columns", [3, 4], ids=["captures", "patterns"])
def test_grouped_in_order_against_brute_force(columns):
    """The no-sort check says yes exactly when every (slot, site) group is one run,
    sorted inside by the remaining columns (position; position then head)."""
    import numpy as np

    from graphtap.courier.groups import grouped_in_order

    rng = np.random.default_rng(1)
    order = tuple(range(columns))
    for _ in range(500):
        n = int(rng.integers(0, 12))
        labels = np.stack([rng.integers(0, 3, n), rng.integers(0, 2, n)] +
                          [rng.integers(0, 4, n) for _ in range(columns - 2)], axis=1) \
            if n else np.zeros((0, columns), int)
        if rng.random() < 0.5:  # often a device-like layout: sorted, groups permuted
            labels = labels[np.lexsort(tuple(labels[:, c] for c in reversed(order)))]
            keys = sorted({tuple(r[:2]) for r in labels.tolist()})
            rng.shuffle(keys)
            labels = np.array([r for k in keys for r in labels.tolist() if tuple(r[:2]) == k]
                              ).reshape(-1, columns)
        seen, ok, prev = set(), True, None
        for r in labels.tolist():
            key = tuple(r[:2])
            if key != (prev[:2] if prev else None):
                ok &= key not in seen
                seen.add(key)
            elif tuple(r[2:]) < tuple(prev[2:]):
                ok = False
            prev = tuple(r)
        assert grouped_in_order(labels, order) == ok, labels


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data())
def test_small_steps_split_in_plain_python_as_the_array_passes_do(data):
    """A small step's split (CaptureStep._split_small) gives every request the same
    tensors under the same keys as the array passes (_split): packs per output format in
    site order, solo sites of SOLO_BYTES or more, casts and chosen heads, rows in
    position order whatever the buffer's order, requests gone or not in the batch left
    out, a request that lost rows its overflow error."""
    from graphtap.courier.pack import SOLO_BYTES

    width, hd = 16, 2
    names = {0: "blocks.0.hook_resid_post", 1: "blocks.0.attn.hook_k",
             2: "blocks.1.attn.hook_v", 3: "blocks.2.hook_resid_post"}
    slots = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True))
    formats = {}
    for slot in slots:
        dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float32]))
        heads = data.draw(st.sampled_from([None, (0, 1), (3, 1), (2,), (1, 2, 3)]))
        formats[slot] = {0: RowFormat(dtype, width, None, 0),
                         1: RowFormat(dtype, 8, heads, hd), 2: RowFormat(dtype, 8, None, hd),
                         3: RowFormat(torch.float32, width, None, 0)}
    # rows: (slot, site, position), each position once per (slot, site); some big enough
    # for a site to go solo (SOLO_BYTES / 64 B rows), in any order
    solo = SOLO_BYTES // (width * 4) + 1
    labels = []
    for slot in slots:
        for site in data.draw(st.lists(st.integers(0, 3), max_size=4, unique=True)):
            n = data.draw(st.sampled_from([1, 2, 5, solo]))
            start = data.draw(st.integers(0, 40))
            labels += [(slot, site, start + p) for p in range(n)]
    labels = data.draw(st.permutations(labels))
    if not labels:
        return
    live = {s: f"r{s}" for s in slots if data.draw(st.booleans()) or s == slots[0]}
    rows = torch.randn(len(labels) + 2, width).to(torch.bfloat16)
    lost = data.draw(st.sampled_from([0, 0, 0, 1]))  # the last row lost: overflow
    label_t = torch.tensor(labels + [(9, 9, 9)] * 2)
    wanted = torch.bincount(label_t[:len(labels), 0], minlength=11)
    count = torch.cat([torch.tensor([len(labels) - lost]), wanted])
    out = []
    for small in (0, 10**6):
        snap = CaptureStep(StepRows(rows, label_t, count, live, formats, names, 100,
                                    OverflowKind.CAPTURE_ROWS))
        snap.small_rows = small
        out.append(snap.per_request())
    arrays, plain = out
    assert arrays.keys() == plain.keys()
    if lost and labels[-1][0] in live:  # only the overflow report, no partial rows
        assert list(arrays[live[labels[-1][0]]]) == [OVERFLOW]
    for req in arrays:
        assert arrays[req].keys() == plain[req].keys(), req
        for key in arrays[req]:
            a, b = arrays[req][key], plain[req][key]
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data())
def test_uniform_steps_split_in_array_passes_as_in_plain_python(data):
    """A step whose requests all ask the same (same sites, same rows at each, the same
    output formats; courier/uniform.py) splits as the plain-Python pass does, rows
    written site-major or request-major, formats shared or equal, in one pack or several
    (heads and whole rows), sites large enough to travel alone among them; and steps
    that differ in one request (a site fewer, another position count, another dtype, a
    request gone) go through the general passes, alike too."""
    from graphtap.courier.pack import SOLO_BYTES
    from graphtap.courier.rows import ORDER
    from graphtap.courier.uniform import split_uniform

    width = 16
    names = {0: "blocks.0.hook_resid_post", 1: "blocks.1.hook_resid_post",
             2: "blocks.2.attn.hook_q"}
    slots = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=5, unique=True))
    sites = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True))
    # rows per site (the same in every request): a site of SOLO_BYTES or more travels
    # alone, beside the others' pack (qk: q at one position, k at every one)
    sizes = st.sampled_from([1, 2, 3, SOLO_BYTES // (width * 2) + 1])
    n = {site: data.draw(sizes) for site in range(3)}
    dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float32]))
    layout = {s: RowFormat(dtype, width, None, 0) if s < 2 else
              RowFormat(dtype, width, (2, 3), 4) for s in range(3)}
    shared = data.draw(st.booleans())
    formats = {slot: layout if shared else dict(layout) for slot in slots}
    odd = data.draw(st.sampled_from(["none", "none", "site", "count", "dtype", "gone"]))
    per_slot = {slot: list(sites) for slot in slots}
    counts = {slot: dict(n) for slot in slots}
    if odd == "site" and len(sites) > 1:
        per_slot[slots[-1]] = sites[:-1]
    elif odd == "count":
        counts[slots[-1]] = {site: k + 1 for site, k in n.items()}
    elif odd == "dtype":
        formats[slots[-1]] = {s: f._replace(dtype=torch.float16) for s, f in layout.items()}
    start = data.draw(st.integers(0, 30))
    groups = [(slot, site) for site in sorted(sites) for slot in slots
              if site in per_slot[slot]]  # site-major, as the device writes them
    if data.draw(st.booleans()):
        groups.sort()  # request-major
    labels = [(slot, site, start + p) for slot, site in groups
              for p in range(counts[slot][site])]
    live = {s: f"r{s}" for s in slots}
    if odd == "gone" and len(slots) > 1:
        del live[slots[-1]]
    rows = torch.randn(len(labels), width).to(torch.bfloat16)
    label_t = torch.tensor(labels)
    out = []
    for small in (0, 10**6):
        snap = step(rows, label_t, len(labels), live, formats, names)
        snap.small_rows = small
        out.append(snap.per_request())
    arrays, plain = out
    assert arrays.keys() == plain.keys()
    for req in arrays:
        assert arrays[req].keys() == plain[req].keys(), req
        for key in arrays[req]:
            a, b = arrays[req][key], plain[req][key]
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key
    snap = step(rows, label_t, len(labels), live, formats, names)
    sorted_labels, perm = snap.sorted_labels(ORDER)
    took = split_uniform(snap, sorted_labels, perm, ORDER) is not None
    # the array path took the uniform passes exactly where every request asks the same
    differs = odd != "none" and len(slots) > 1 and (odd != "site" or len(sites) > 1)
    assert took == (not differs and len(labels) > 1)
