"""A request's capture rows of one step travel packed (courier/pack.py): one rows tensor
per output format and one index, instead of two tensors per site."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphtap.courier import CaptureStep, RowFormat, StepRows
from graphtap.courier.chunks import OverflowKind
from graphtap.courier.pack import PACK, pack_key, packed_index, unpack
from graphtap.courier.payload import open_payload, seal

HS = {s: f"blocks.{s}.hook_resid_post" for s in range(3)}


def step(labels, formats, names, width=16, dtype=torch.bfloat16):
    labels = torch.tensor(labels)
    n = len(labels)
    count = torch.cat([torch.tensor([n]), torch.bincount(labels[:, 0], minlength=len(formats))])
    rows = torch.randn(n, width).to(dtype)
    return CaptureStep(StepRows(rows, labels, count, {s: f"r{s}" for s in formats}, formats,
                                names, 100, OverflowKind.CAPTURE_ROWS)), rows


def test_a_request_of_three_residual_sites_gets_one_pack_and_one_index():
    """Site-major as the device writes them: 2 requests x 3 sites, r0 two tokens."""
    fmt = RowFormat(torch.bfloat16, 16, None, 0)
    labels = [(r, s, p) for s in range(3) for r, ps in ((0, (4, 5)), (1, (9,))) for p in ps]
    snap, rows = step(labels, {0: dict.fromkeys(range(3), fmt),
                               1: dict.fromkeys(range(3), fmt)}, HS)
    out = snap.per_request()
    key = pack_key([HS[0], HS[1], HS[2]])
    assert set(out["r0"]) == {key, f"{key}@positions"}  # 2 tensors, not 6
    # the pack: r0's rows site by site; the index: rows per site, then positions
    assert out["r0"][f"{key}@positions"].tolist() == [2, 2, 2, 4, 5, 4, 5, 4, 5]
    want = rows[[0, 1, 3, 4, 6, 7]]
    assert torch.equal(out["r0"][key], want)
    got = unpack(out["r1"])
    for s, name in HS.items():
        assert torch.equal(got[name], rows[[2 + 3 * s]]) and got[f"{name}@positions"].tolist() == [9]


def test_q_and_k_of_the_same_heads_share_a_pack_and_dtypes_do_not():
    """q (4 heads of 2) and k (2 heads) read the same columns for heads (0, 1): one pack;
    a float32 request's rows are a pack of their own format."""
    names = {0: "blocks.0.attn.hook_q", 1: "blocks.0.attn.hook_k"}
    bf = {0: RowFormat(torch.bfloat16, 8, (0, 1), 2), 1: RowFormat(torch.bfloat16, 4, (0, 1), 2)}
    f32 = {s: f._replace(dtype=torch.float32) for s, f in bf.items()}
    labels = [(0, 0, 3), (1, 0, 3), (0, 1, 0), (0, 1, 1), (0, 1, 2), (0, 1, 3), (1, 1, 3)]
    snap, rows = step(labels, {0: bf, 1: f32}, names, width=8)
    out = snap.per_request()
    assert [k for k in out["r0"] if "@" not in k] == [PACK + "blocks.0.attn.hook_q,blocks.0.attn.hook_k"]
    got = {r: unpack(c) for r, c in out.items()}
    assert torch.equal(got["r0"][names[1]], rows[2:6, :4].reshape(4, 2, 2))
    assert got["r1"][names[0]].dtype == torch.float32
    assert torch.equal(got["r1"][names[0]], rows[[1], :4].reshape(1, 2, 2).float())


def test_a_pack_whose_counts_do_not_add_up_fails_that_request_with_the_reason():
    from graphtap.frontend import GraphtapFrontend
    from graphtap.spec import ModelShape

    key = pack_key(["a", "b"])
    bad = {key: torch.zeros(3, 4), f"{key}@positions": torch.tensor([1, 1, 0, 1, 2])}
    with pytest.raises(ValueError, match="counts"):
        unpack(bad)
    shape = ModelShape(num_layers=1, hidden_size=4, max_model_len=8, configured_sites=set(),
                       max_steers=1, max_vectors=1, max_captures=1, num_heads=1,
                       num_kv_heads=1, save_root=None)
    out = GraphtapFrontend(shape).finish_outputs("r", [seal(bad)])
    assert "could not assemble" in out.error and "counts" in out.error


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=4), max_size=6))
def test_packed_index_against_a_loop(requests):
    """requests: per request, its rows per site."""
    counts = np.array([c for r in requests for c in r], np.int64)
    sites = np.array([len(r) for r in requests], np.int64)
    rows = np.array([sum(r) for r in requests], np.int64)
    positions = np.arange(int(rows.sum()), dtype=np.int64) + 100
    want, at = [], 0
    for r in requests:
        want += r + positions[at:at + sum(r)].tolist()
        at += sum(r)
    assert packed_index(counts, sites, rows, positions).tolist() == want


def test_attention_masses_come_packed_and_a_focus_guard_reads_them():
    """A focus guard's sites (mass per head and span at the last prompt token) were two
    tensors per site a request; now one pack, which the worker-side guard reads."""
    from graphtap.courier.chunks import FINISH
    from graphtap.courier.guard import apply_guards
    from graphtap.courier.patterns import MassFormat, MassStep
    from graphtap.spec.entries import GuardEntry

    names = {0: "mass:blocks.0.attn.hook_pattern", 1: "mass:blocks.1.attn.hook_pattern"}
    heads, spans = 2, 2
    labels = torch.tensor([(r, s, 4, h) for s in (0, 1) for r in (0, 1) for h in range(heads)])
    # request 0 looks at the instruction span (0.9 of its mass), request 1 away (0.2)
    rows = torch.tensor([[0.9, 0.1] if r == 0 else [0.2, 0.8] for _, r in
                         ((s, r) for s in (0, 1) for r in (0, 1) for _ in range(heads))])
    count = torch.tensor([len(labels), 4, 4])
    fmt = MassFormat(heads, spans)
    snap = MassStep(StepRows(rows, labels, count, {0: "a", 1: "b"},
                             {0: {0: fmt, 1: fmt}, 1: {0: fmt, 1: fmt}}, names, 100,
                             OverflowKind.MASS_ROWS))
    out = snap.per_request()
    assert [k for k in out["a"] if "@" not in k] == [pack_key([names[0], names[1]])]
    got = unpack(out["b"])
    assert torch.equal(got[names[1]], torch.tensor([[[0.2, 0.8], [0.2, 0.8]]]))
    assert got[f"{names[0]}@positions"].tolist() == [4]
    guard = GuardEntry("attention_focus", 0.5, True, tuple(names.values()))
    apply_guards(out, {"a": (guard, 5), "b": (guard, 5)})
    assert FINISH in out["b"] and FINISH not in out["a"]


def test_large_sites_travel_alone_and_the_frontend_keeps_them_without_a_copy():
    """k at every prompt position is SOLO_BYTES or more a request: its own tensor (its own
    frame through vLLM's msgpack path), kept as the result at finish; packed sites are
    copied apart there (a pack of 64 qk requests' k rows cost the frontend's event loop
    0.25-0.45 s on the H200 host). q at the last position stays packed."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from graphtap.courier import assemble
    from graphtap.courier.pack import SOLO_BYTES, row_bytes

    hd, heads = 64, (0, 1, 2, 3)
    names = {0: "blocks.0.attn.hook_q", 1: "blocks.0.attn.hook_k"}
    fmt = {0: RowFormat(torch.bfloat16, 8 * hd, heads, hd), 1: RowFormat(torch.bfloat16, 4 * hd, heads, hd)}
    k_rows = 40
    assert k_rows * row_bytes(fmt[1]) >= SOLO_BYTES > row_bytes(fmt[0])
    labels = [(r, 0, k_rows - 1) for r in (0, 1)] + [(r, 1, p) for r in (0, 1) for p in range(k_rows)]
    snap, rows = step(labels, {0: fmt, 1: fmt}, names, width=8 * hd)
    out = snap.per_request()
    assert set(out["r1"]) == {pack_key([names[0]]), f"{pack_key([names[0]])}@positions",
                              names[1], f"{names[1]}@positions"}
    sent = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=r, new_token_ids=[1],
                                                       hook_outputs=[seal(c)]) for r, c in out.items()])
    back = MsgpackDecoder(EngineCoreOutputs).decode(
        [bytes(f) for f in MsgpackEncoder().encode(sent)])
    chunk = open_payload(back.outputs[1].hook_outputs[0])
    done = assemble([chunk])
    k = rows[2 + k_rows:2 + 2 * k_rows, :4 * hd].reshape(k_rows, 4, hd)
    assert torch.equal(done[names[1]], k) and done.positions[names[1]].tolist() == list(range(k_rows))
    assert done[names[1]].data_ptr() == chunk[names[1]].data_ptr()  # kept, not copied
    assert torch.equal(done[names[0]], rows[[1], :4 * hd].reshape(1, 4, hd))
