"""A deferred step shipped whole to the frontend and split there (courier/shipped.py,
patch 0008's HookPayload.ship and HookFrontend.rows_arrived): what each request gets is
what the engine's own split made, value for value, through vLLM's own encoding."""
import torch
from vllm.v1.engine import EngineCoreOutputs, FinishReason
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
from vllm.v1.worker.gpu.hooks import settle_hook_rows, split_hook_rows

from graphtap.courier import RowFormat, StepSnapshots
from graphtap.courier.chunks import ERROR, error_message, positions_key
from graphtap.courier.pack import unpack
from graphtap.courier.later import Unsettled
from graphtap.courier.payload import open_payload
from graphtap.courier.shipped import ShippedRows, is_shipped, shippable
from helpers import capture_step
from test_courier_later import NAMES, opened, out, qk_step, same

Q = RowFormat(torch.bfloat16, 1024, (0, 1, 2, 3, 4, 5, 6, 7), 128)


def mixed_step():
    """Not uniform: r0 and r1 capture k at 2 sites at every position, r2 at one site
    and the last position only, in another format (the chunk way)."""
    rows, labels, slot_to_req, formats = qk_step(reqs=2)
    labels = labels + [(2, 1, 79)]
    rows = torch.cat([rows, torch.randn(1, 512).to(torch.bfloat16)])
    return rows, labels, slot_to_req | {2: "r2"}, formats | {2: {1: Q}}


def deferred(data, ship=True, unsettled=None):
    rows, labels, slot_to_req, formats = data
    unsettled = unsettled or Unsettled(ship=ship)
    return StepSnapshots([capture_step(rows, labels, len(labels), slot_to_req, formats, NAMES)],
                         unsettled=unsettled).per_request(None)


def local(data):
    rows, labels, slot_to_req, formats = data
    return StepSnapshots([capture_step(rows, labels, len(labels), slot_to_req, formats,
                                       NAMES)])._per_request(None)


def through_vllm(later: dict, finishing=()):
    """The step's message and its rows' message as the engine core's output thread
    makes and sends them (split_hook_rows, settle_hook_rows, vLLM's msgpack encoder),
    decoded as the frontend's client decodes them."""
    step = EngineCoreOutputs(outputs=[
        out(r, [1], [p], FinishReason.STOP if r in finishing else None)
        for r, p in later.items()])
    rows = split_hook_rows(step)
    rows = settle_hook_rows(rows) if rows is not None else None
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    return [dec.decode(enc.encode(m)) for m in (step, rows) if m is not None]


def frontend_side(messages, shipped: ShippedRows) -> dict[str, list]:
    """Each request's payloads as the output processor keeps them (patch 0008)."""
    kept: dict[str, list] = {}
    for m in messages:
        for o in m.outputs:
            payloads = shipped.arrived(o.request_id, o.hook_outputs or []) \
                if o.hooks_only else list(o.hook_outputs or [])
            kept.setdefault(o.request_id, []).extend(payloads)
    return kept


def test_a_shipped_step_gives_each_request_what_the_engines_split_gave():
    for data in (qk_step(), mixed_step()):
        later, now = deferred(data), local(data)
        split = next(iter(later.values())).split
        messages = through_vllm(later)
        assert split._made is None and split._snapshots is None  # nothing split here
        assert len(messages) == 2
        sent = [p for o in messages[1].outputs for p in o.hook_outputs]
        assert sum(p.inline[:4] == b"\xc1gtB" for p in sent) == 1  # one bundle
        assert all(is_shipped(p) for p in sent)  # the others: markers
        shipped = ShippedRows()
        kept = frontend_side(messages, shipped)
        assert kept.keys() == now.keys()
        assert all(is_shipped(p) for ps in kept.values() for p in ps)  # until the finish
        assert shipped.waiting() == len(now)
        for req, payloads in kept.items():
            (got,) = shipped.resolve(req, payloads)
            assert same(unpack(opened(got)), unpack(opened(now[req]))), req
        assert shipped.waiting() == 0


def test_the_finish_of_a_shipped_request_copies_nothing_on_the_output_handler():
    """The split thread leaves each request's values unpacked, in storage of their own
    (or of the request's own pack: within its values' bytes), so the finish (assemble,
    on the output handler) keeps them as they are: before, they were views of the whole
    step's buffer, and the finish copied each request's rows out of it while every
    token of that message waited."""
    from graphtap.courier import assemble, open_chunks

    data = qk_step()
    shipped = ShippedRows()
    kept = frontend_side(through_vllm(deferred(data)), shipped)
    now = local(data)
    for req, payloads in kept.items():
        (got,) = shipped.resolve(req, payloads)
        within = sum(t.nbytes for t in got.frames.values())
        assert got.frames and all(t.untyped_storage().nbytes() <= within
                                  for t in got.frames.values()), req
        out = assemble([c for c in open_chunks(got)])
        assert out.keys() == {NAMES[1], NAMES[2]}
        for name in out:  # the frames themselves, not copies of them
            assert out[name].data_ptr() == got.frames[name].data_ptr(), (req, name)
            assert out.positions[name].data_ptr() == \
                got.frames[positions_key(name)].data_ptr(), (req, name)
        expect = assemble([c for c in open_chunks(now[req])])
        assert all(torch.equal(out[k], expect[k]) and
                   torch.equal(out.positions[k], expect.positions[k]) for k in expect)


def test_a_finishing_request_gets_a_marker_its_finish_resolves():
    data = qk_step()
    now = local(data)
    later = deferred(data)
    # r0 ships the step (the rows' message of an earlier step); r1 finishes a step
    # later: the engine settles its payload in that step's message, a marker
    first = {"r0": later["r0"], "r2": later["r2"]}
    shipped = ShippedRows()
    kept = frontend_side(through_vllm(first), shipped)
    kept |= frontend_side(through_vllm({"r1": later["r1"]}, finishing={"r1"}), shipped)
    assert all(is_shipped(kept[r][0]) for r in ("r0", "r1", "r2"))
    for r in ("r0", "r1", "r2"):
        (got,) = shipped.resolve(r, kept[r])
        assert same(unpack(opened(got)), unpack(opened(now[r]))), r
    assert shipped.waiting() == 0


def test_an_aborted_request_leaves_nothing_behind_and_a_lost_bundle_is_an_error():
    later = deferred(qk_step())
    shipped = ShippedRows()
    frontend_side(through_vllm({"r0": later["r0"]}), shipped)
    assert shipped.waiting() == 3
    for r in ("r0", "r1", "r2"):  # aborted: their markers may still come, and go
        shipped.release(r)
    assert shipped.waiting() == 0
    # a bundle that comes after some of its requests were aborted keeps nothing for them
    picky = ShippedRows(live=lambda r: r != "r1")
    frontend_side(through_vllm({"r0": deferred(qk_step())["r0"]}), picky)
    assert picky.waiting() == 2
    # a marker whose bundle this frontend never saw fails that request's hooks, loudly
    marker = through_vllm({"r1": later["r1"]})[-1].outputs[0].hook_outputs[0]
    lost = shipped.resolve("r1", [marker])
    assert "never reached this frontend" in error_message(open_payload(lost[0])[ERROR])


def test_a_bundle_the_frontend_cannot_split_fails_its_requests_not_the_frontend():
    later = deferred(qk_step())
    messages = through_vllm(later)
    bundle = messages[1].outputs[0].hook_outputs[0]
    bundle.frames.pop("0.labels")
    shipped = ShippedRows()
    kept = frontend_side(messages, shipped)
    for req in ("r0", "r1", "r2"):
        got = open_payload(shipped.resolve(req, kept[req])[0])
        assert "could not split a step's rows (KeyError" in error_message(got[ERROR])
    # a bundle that does not decode: its requests' hooks fail, the output handler goes on
    messages = through_vllm(deferred(qk_step()))
    carrier = messages[1].outputs[0]  # the first request the output thread took
    carrier.hook_outputs[0].inline = b"\xc1gtB" + b"\xff"
    shipped = ShippedRows()
    kept = frontend_side(messages, shipped)
    for req in ("r0", "r1", "r2"):
        got = open_payload(shipped.resolve(req, kept[req])[0])
        why = "could not read a step's shipped rows" if req == carrier.request_id else \
            "never reached"
        assert why in error_message(got[ERROR]), req


def test_what_ships_and_what_splits_in_the_engine():
    data = qk_step()
    # without shipping (several API servers, or hook_config.split_in_frontend off)
    later = deferred(data, ship=False)
    sent = [p for m in through_vllm(later) for o in m.outputs
            for p in o.hook_outputs or ()]
    assert not any(is_shipped(p) for p in sent)
    # a settle before any ship (a finishing request first) splits in the engine: the
    # rest then travel split, none as markers
    later = deferred(data)
    split = later["r1"].split
    messages = through_vllm(later, finishing={"r1"})
    assert split._made is not None
    assert not any(is_shipped(p) for m in messages for o in m.outputs
                   for p in o.hook_outputs or ())
    # a step no message took yet is split at the next step, as before (the pinned copy
    # does not wait), and one that went whole is not split again
    unsettled = Unsettled(ship=True)
    waiting = deferred(data, unsettled=unsettled)
    shipped = deferred(data, unsettled=unsettled)
    through_vllm(shipped)
    deferred(data, unsettled=unsettled)  # the next step: makes the older ones
    assert waiting["r0"].split._made is not None
    assert shipped["r0"].split is None  # handed out
    # only plain capture steps with row formats ship
    rows, labels, slot_to_req, formats = data
    step = capture_step(rows, labels, len(labels), slot_to_req, formats, NAMES)
    assert shippable([step])
    step.formats = {0: {1: ("not", "a", "row", "format")}}
    assert not shippable([step])
