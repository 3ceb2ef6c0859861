"""A request's chunk of one step sealed into vLLM's HookPayload and opened in the frontend
(courier/payload.py): the same tensors come back, small values travel inside the
message (no tensor of their own for vLLM's msgpack hooks), large ones as frames."""
import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import HookPayload
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from graphtap.courier.chunks import FINISH
from graphtap.courier.payload import DTYPES, INLINE_BYTES, Inline, open_payload, seal


def through_vllm(payloads: list) -> tuple[list, int]:
    """The payloads after vLLM's engine-core -> frontend encoding, and its frame count."""
    sent = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=f"r{i}", new_token_ids=[1],
                                                       hook_outputs=[p])
                                      for i, p in enumerate(payloads)])
    frames = MsgpackEncoder().encode(sent)
    back = MsgpackDecoder(EngineCoreOutputs).decode([bytes(f) for f in frames])
    return [o.hook_outputs[0] for o in back.outputs], len(frames)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k])
        for k in a)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 5), max_size=3),
       st.booleans())
def test_any_value_comes_back_equal(dtype, shape, transposed):
    t = (torch.rand(shape) * 100).to(DTYPES[dtype])
    if transposed and t.dim() >= 2:
        t = t.transpose(0, 1)  # not contiguous
    chunk = {"x": t, "x@positions": torch.arange(len(t) if t.dim() else 1)}
    assert same(open_payload(seal(chunk)), chunk)
    assert same(open_payload(through_vllm([seal(chunk)])[0][0]), chunk)


def test_stride_zero_and_empty_values_travel():
    """numpy hands empty selections stride 0 (courier/held.py); expanded rows are too."""
    chunk = {"e": torch.empty(0, 2)[:, :], "z": torch.ones(1, 4).expand(3, 4),
             "n": torch.zeros(0, dtype=torch.int64)}
    assert same(open_payload(through_vllm([seal(chunk)])[0][0]), chunk)


def test_small_values_ride_inside_the_message_large_ones_as_frames():
    """The regression: 64 requests of a decode step, each with a pack of 3 sites' rows
    and its index, made 65 frames (one per rows tensor past 256 bytes, then the message)
    and 128 tensors' msgpack hook calls on each side; now the message is one frame, and
    only a value of INLINE_BYTES or more gets a frame of its own."""
    small = [seal({"pack": torch.randn(3, 4096).to(torch.bfloat16),
                   "pack@positions": torch.tensor([1, 1, 1, 7, 7, 7])}) for _ in range(64)]
    _, frames = through_vllm(small)
    assert frames == 1
    _, frames = through_vllm([HookPayload(frames=open_payload(p)) for p in small])
    assert frames == 65  # the same values as tensors, as vLLM sent them before
    big = torch.randn(INLINE_BYTES // 4).reshape(-1, 64)  # exactly INLINE_BYTES
    payload = seal({"k": big, "k@positions": torch.arange(len(big))})
    assert list(payload.frames) == ["k"] and payload.frames["k"] is big
    (back,), frames = through_vllm([payload])
    assert frames == 2 and same(open_payload(back), {"k": big, "k@positions": torch.arange(len(big))})


def test_a_request_that_may_stop_on_a_string_sends_large_values_inside_the_message():
    """The frontend checks stop strings and may finish a request on a step's tokens; a
    frame would go in a message after them (patch 0008) and miss the finish. Sealed
    `all_inline`, a large value rides inside the step's message, equal."""
    big = torch.randn(INLINE_BYTES // 2).reshape(-1, 64)
    payload = seal({"k": big, "k@positions": torch.arange(len(big))}, all_inline=True)
    assert payload.frames == {} and payload.inline
    (back,), frames = through_vllm([payload])
    assert frames == 1 and same(open_payload(back), {"k": big, "k@positions": torch.arange(len(big))})


def test_a_guard_stop_becomes_the_payload_flag():
    payload = seal({FINISH: torch.ones(1, dtype=torch.int8), "s": torch.ones(1, 2)})
    assert payload.finish and payload.frames == {}
    (back,), _ = through_vllm([payload])
    assert back.finish and FINISH in open_payload(back)
    assert not seal({"s": torch.ones(1, 2)}).finish


def test_an_unknown_dtype_in_a_payload_is_refused_by_name():
    blob = msgspec.msgpack.encode({"x": Inline("__class__", (1,), bytearray(4))})
    with pytest.raises(ValueError, match="'x' has dtype '__class__'"):
        open_payload(HookPayload(inline=blob))


def test_sealing_makes_no_reshape_or_view_per_value():
    """Each torch call that dispatches releases the GIL to the engine core's busy loop:
    a value's bytes are read through numpy (no call that dispatches for a contiguous
    value of numpy's dtypes; one view for bfloat16, which numpy lacks)."""
    from torch.overrides import TorchFunctionMode

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    chunk = {**{f"i{k}": torch.arange(5) for k in range(4)},
             **{f"f{k}": torch.randn(2, 3) for k in range(4)},
             **{f"b{k}": torch.randn(2, 3).to(torch.bfloat16) for k in range(4)}}
    with Calls() as calls:
        sealed = seal(chunk)
    dispatched = [c for c in calls.seen if c in ("view", "reshape", "contiguous", "flatten")]
    assert dispatched == ["view"] * 4
    assert same(open_payload(sealed), chunk)


def test_own_keeps_a_view_within_its_requests_values_and_copies_one_of_more():
    """payload.own: a request's values may share storage among themselves (a step's
    pack of its sites, unpacked into views: the frontend's split thread copied each,
    about 1000 copies a qk step), never a larger one (a whole step's rows: the request
    would keep them alive)."""
    from graphtap.courier.payload import own

    pack = torch.arange(12.0).view(6, 2)  # one request's pack: 3 sites of 2 rows
    site = pack[2:4]
    assert own(site, within=pack.nbytes) is site  # within the request's values: kept
    copied = own(site)  # no allowance: its own storage
    assert copied.data_ptr() != site.data_ptr() and torch.equal(copied, site)
    assert copied.untyped_storage().nbytes() == site.nbytes
    step = torch.zeros(100, 2)  # a whole step's rows
    view = own(step[4:6], within=pack.nbytes)
    assert view.untyped_storage().nbytes() == view.nbytes  # copied out of the step
    column = own(pack[:, 0], within=pack.nbytes)  # not contiguous: copied whatever
    assert column.is_contiguous() and torch.equal(column, pack[:, 0])
