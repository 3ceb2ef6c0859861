"""Capture steps sealed straight from the host copy (courier/direct.py): the same payloads
as the chunk way (byte for byte where that is CaptureStep._split_small, then seal; the
same values where it is the array passes), and no torch call per request (each one
releases the GIL to the engine core's busy loop)."""
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from graphtap.courier import CaptureStep, RowFormat, StepSnapshots
from graphtap.courier.pack import unpack
from graphtap.courier.payload import open_payload, seal

from helpers import capture_step

HD = 2
NAMES = {0: "blocks.0.hook_resid_post", 1: "blocks.0.attn.hook_k", 2: "blocks.1.attn.hook_v",
         3: "blocks.2.hook_resid_post"}


def fmt_pool(width: int) -> dict[str, RowFormat]:
    return {"resid": RowFormat(torch.bfloat16, width, None, 0),
            "heads": RowFormat(torch.bfloat16, 8, (1, 2), HD),  # one run
            "all": RowFormat(torch.bfloat16, 8, None, HD),
            "gaps": RowFormat(torch.bfloat16, 8, (3, 0), HD),  # runs: the tensor path
            "f32": RowFormat(torch.float32, width, None, 0)}  # a cast: the tensor path


DIRECT = {"resid", "heads", "all"}


def make(rows, labels, used, slot_to_req, formats):
    return capture_step(rows, labels, used, slot_to_req, formats, NAMES)


@st.composite
def steps(draw):
    width = draw(st.sampled_from([16, 4096]))
    pool = fmt_pool(width)
    slots = draw(st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True))
    kinds = {s: {site: draw(st.sampled_from(sorted(pool)))
                 for site in draw(st.sets(st.integers(0, 3), min_size=1, max_size=3))}
             for s in slots}
    labels = [(s, site, p) for s in slots for site in kinds[s]
              for p in draw(st.sets(st.integers(0, 40), min_size=1, max_size=6))]
    labels = draw(st.permutations(labels))[:48]  # past small_rows: the array passes
    gone = draw(st.booleans()) and labels  # a slot whose request went: rows, no request
    if gone:
        labels = labels[:-1] + [(9, labels[-1][1], 0)]
    formats = {s: {site: pool[k] for site, k in kinds[s].items()} for s in slots}
    return width, pool, kinds, labels, formats


@st.composite
def uniform_steps(draw, most_rows: int = 4, kinds_from=None, widths=(16, 4096)):
    """Steps whose requests all ask the same: the same sites, formats and rows per site
    (their positions their own), in the device's site-major order or shuffled; at
    times one request asks otherwise, or a slot's request went. `most_rows` at a site
    (of 4096 columns; 4 of 16: from 8 on, few or many), formats drawn from
    `kinds_from` (all the pool's)."""
    width = draw(st.sampled_from(widths))
    pool = fmt_pool(width)
    slots = draw(st.lists(st.integers(0, 7), min_size=1, max_size=6, unique=True))
    kinds = dict.fromkeys(draw(st.sets(st.integers(0, 3), min_size=1, max_size=3)))
    kinds = {site: draw(st.sampled_from(kinds_from or sorted(pool))) for site in kinds}
    rows = st.sampled_from([1, 2, 4, 8, most_rows]) if most_rows >= 8 and width > 16 else \
        st.integers(1, 4)
    rows_at = {site: draw(rows) for site in kinds}
    labels = [(s, site, p) for site in sorted(kinds) for s in slots
              for p in draw(st.sets(st.integers(0, 40), min_size=rows_at[site],
                                    max_size=rows_at[site]))]
    if draw(st.booleans()):
        labels = draw(st.permutations(labels))
    formats = {s: {site: pool[k] for site, k in kinds.items()} for s in slots}
    odd = draw(st.sampled_from(["none", "format", "gone"]))
    if odd == "format" and len(slots) > 1:  # one request asks another format
        formats[slots[-1]] = {site: pool["f32" if k != "f32" else "resid"]
                              for site, k in kinds.items()}
    if odd == "gone":  # its rows and formats, no request id
        labels = [(9 if s == slots[-1] else s, site, p) for s, site, p in labels]
        formats[9] = formats[slots[-1]]
    per_slot = {s: {site: kinds[site] for site in kinds} for s in slots}
    if odd == "format" and len(slots) > 1:
        per_slot[slots[-1]] = {site: "f32" if k != "f32" else "resid"
                               for site, k in kinds.items()}
    return width, pool, per_slot, labels, formats


def test_uniform_steps_take_the_array_passes():
    """A burst's steps of one spec are sealed in array passes (seal_uniform), not the
    plain-Python walk; a step with one request asking otherwise is not."""
    from graphtap.courier import direct

    labels = [(r, site, 7 + r) for site in range(3) for r in range(4)]
    fmt = RowFormat(torch.bfloat16, 16, None, 0)
    rows = torch.randn(len(labels), 16).to(torch.bfloat16)
    formats = {r: dict.fromkeys(range(3), fmt) for r in range(4)}
    snap = make(rows, labels, len(labels), {r: f"r{r}" for r in range(4)}, formats)
    args = (snap.labels.numpy()[:len(labels), :3], snap.rows.view(torch.uint8).numpy(),
            torch.bfloat16, formats, NAMES, {r: f"r{r}" for r in range(4)})
    got = seal_uniform(snap)
    assert got is not None and got == direct.seal_small(*args)
    formats[3] = dict.fromkeys(range(3), RowFormat(torch.float32, 16, None, 0))
    assert seal_uniform(snap) is None
    formats[3] = formats[0]  # slot 3's request went (its rows stay, no request id)
    gone = make(rows, labels, len(labels), {r: f"r{r}" for r in range(3)}, formats)
    assert seal_uniform(gone) is None and list(direct.seal_small(
        *args[:-1], {r: f"r{r}" for r in range(3)})) == ["r0", "r1", "r2"]


def seal_uniform(snap):
    """The array passes on a step where its layout is uniform (as CaptureStep.sealed
    takes them from uniform_rows rows on), else None."""
    from graphtap.courier import direct
    from graphtap.courier.rows import ORDER
    from graphtap.courier.uniform import uniform_layout

    layout = uniform_layout(snap, *snap.sorted_labels(ORDER), ORDER)
    return direct.seal_uniform(layout, snap.rows.view(torch.uint8).numpy(),
                               snap.rows.dtype) if layout else None


@settings(max_examples=150, deadline=None)
@given(st.one_of(steps(), uniform_steps()), st.integers(0, 2**31))
def test_direct_payloads_equal_the_chunk_way(case, seed):
    width, pool, kinds, labels, formats = case
    used = len(labels)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(used + 2, width, generator=g).to(torch.bfloat16)
    labels = labels + [(8, 0, 0)] * 2  # unused rows past the count
    slot_to_req = {s: f"r{s}" for s in kinds} | {9 - 1: "idle"}
    old = StepSnapshots([make(rows, labels, used, slot_to_req, formats)])
    want = {req: seal(c) for req, c in old.chunks().items()}
    snap = make(rows, labels, used, slot_to_req, formats)
    values = snap.sealed()
    got = StepSnapshots([make(rows, labels, used, slot_to_req, formats)])._per_request(None)
    assert got.keys() == want.keys()
    for req in want:
        a, b = open_payload(got[req]), open_payload(want[req])
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), req
        if used <= CaptureStep.small_rows:  # the chunk way split in plain Python
            assert got[req].inline == want[req].inline, req  # byte for byte
    live = {(s, site) for s, site, _ in labels[:used] if s in kinds}
    native = all(kinds[s][site] in DIRECT for s, site in live)
    if width == 16 and native:  # nothing travels as a frame: the direct path took it
        assert values is not None and all(not p.frames for p in got.values())
    if not native:
        assert values is None
    # the array passes (taken by steps of CaptureStep.uniform_rows rows or more) make
    # what the plain walk does, wherever they take a step
    from graphtap.courier import direct

    args = (snap.labels.numpy()[:used, :3], snap.rows.view(torch.uint8).numpy(),
            torch.bfloat16, formats, NAMES, slot_to_req)
    uniform = seal_uniform(snap) if used else None
    if uniform is not None:
        assert uniform == direct.seal_small(*args)


@settings(max_examples=150, deadline=None)
# up to 12 rows of 4096 columns at a site: they then travel as a frame (INLINE_BYTES)
@given(uniform_steps(12, ["resid", "resid", "resid", "heads", "all", "f32"], (4096,)),
       st.integers(0, 2**31), st.data())
def test_large_uniform_steps_sealed_as_the_chunk_way(case, seed, data):
    """A step of any size whose requests all ask the same (CaptureStep.sealed from
    direct_rows rows on: a qk burst's prefill steps) is sealed from one copy per format
    (direct.seal_request_major): each request's payload byte for byte what seal() makes
    of split_uniform's chunk, its frames the same tensors, and a request whose values
    must all travel inside the message (a stop string) gets no frame."""
    from graphtap.courier import direct
    from graphtap.courier.rows import ORDER
    from graphtap.courier.snapshot import _frames_apart
    from graphtap.courier.uniform import split_uniform
    from graphtap.courier.payload import seal_values

    width, pool, kinds, labels, formats = case
    rows = torch.randn(len(labels), width,
                       generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    slot_to_req = {s: f"r{s}" for s in kinds}
    inline = data.draw(st.sets(st.sampled_from(sorted(slot_to_req.values()))))
    snap = make(rows, labels, len(labels), slot_to_req, formats)
    order = snap.sorted_labels(ORDER)
    chunks = split_uniform(snap, *order, ORDER)
    got = direct.seal_request_major(snap, *order, ORDER, snap.rows.view(torch.uint8).numpy(),
                                    torch.bfloat16, inline)
    native = all(k in DIRECT for per in kinds.values() for k in per.values())
    assert (got is None) == (chunks is None or not native)
    event(f"sealed: {got is not None}")
    if got is None:
        return
    event(f"frames: {any(isinstance(v, torch.Tensor) for r in got.values() for v in r.values())}")
    assert got.keys() == chunks.keys()
    for req, chunk in chunks.items():
        want, mine = seal(chunk, all_inline=req in inline), seal_values(*_frames_apart(got[req]))
        assert mine.inline == want.inline, req  # byte for byte
        assert list(mine.frames) == list(want.frames), req
        assert all(torch.equal(mine.frames[k], want.frames[k]) for k in want.frames), req
        assert not (req in inline and mine.frames)


def test_a_large_step_goes_the_direct_way():
    """A qk prefill step of 8 requests (k at 256 positions, q at the last, 4 layers):
    past direct_rows rows, sealed from one copy (no chunks), its k rows as frames, the
    same payloads as the chunk way; a request that may finish on a stop string gets its
    values inside the message."""
    reqs, fmt = 8, RowFormat(torch.bfloat16, 256, None, 128)  # a k row: 2 heads
    labels = [(r, site, p) for site in range(4) for r in range(reqs)
              for p in (range(256) if site % 2 else [255])]
    rows = torch.randn(len(labels), 256).to(torch.bfloat16)
    slot_to_req = {r: f"r{r}" for r in range(reqs)}
    formats = {r: dict.fromkeys(range(4), fmt) for r in range(reqs)}
    snap = StepSnapshots([make(rows, labels, len(labels), slot_to_req, formats)],
                         inline={"r3"})
    assert len(labels) > CaptureStep.direct_rows
    assert make(rows, labels, len(labels), slot_to_req, formats).sealed() is not None
    got = snap._per_request(None)
    want = {req: seal(c, all_inline=req == "r3") for req, c in StepSnapshots(
        [make(rows, labels, len(labels), slot_to_req, formats)]).chunks().items()}
    assert got.keys() == want.keys()
    for req in want:
        assert got[req].inline == want[req].inline
        assert list(got[req].frames) == list(want[req].frames)
        assert all(torch.equal(got[req].frames[k], want[req].frames[k])
                   for k in want[req].frames)
    assert list(got["r0"].frames) == [NAMES[1], NAMES[3]] and not got["r3"].frames
    k = unpack(open_payload(got["r5"]))[NAMES[1]]
    assert torch.equal(k, rows[[i for i, (s, site, _) in enumerate(labels)
                                if s == 5 and site == 1]].view(256, 2, 128))


def test_no_torch_call_per_request():
    """The direct path's torch calls are per step, not per request or value."""

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    def calls(reqs: int) -> int:
        labels = [(r, site, 7) for site in range(3) for r in range(reqs)]
        fmt = RowFormat(torch.bfloat16, 4096, None, 0)
        snap = StepSnapshots([make(torch.randn(len(labels), 4096).to(torch.bfloat16), labels,
                                   len(labels), {r: f"r{r}" for r in range(reqs)},
                                   {r: dict.fromkeys(range(3), fmt) for r in range(reqs)})])
        Count.calls = 0
        with Count():
            out = snap._per_request(None)
        assert len(out) == reqs
        return Count.calls

    assert calls(1) == calls(8) <= 8
    # past direct_rows rows (sealed from one copy per format): none per request either
    assert calls(200) == calls(400) <= 16


def test_a_step_copy_that_is_not_contiguous_goes_the_chunk_way():
    """The direct seal reads the rows as bytes: rows that are a strided view (not what
    the capture family hands over, but a LabelledStep may be built so) are split the
    chunk way instead of failing the step."""
    labels = [(0, 0, 3), (0, 0, 4)]
    fmt = RowFormat(torch.bfloat16, 8, None, 0)
    rows = torch.arange(2.0, dtype=torch.bfloat16)[:, None].expand(2, 8)
    snap = StepSnapshots([make(rows, labels, 2, {0: "a"}, {0: {0: fmt}})])
    snap.parts[0].rows = rows  # make() clones: keep the strided view
    got = unpack(open_payload(snap._per_request(None)["a"]))
    assert got[f"{NAMES[0]}@positions"].tolist() == [3, 4]
    assert torch.equal(got[NAMES[0]], rows)
