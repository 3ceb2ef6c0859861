"""The per-request slot block (engine/slots.py): a slot's reset puts exactly its
fields' inactive values back (scalar fills and fills along the last dimension, int32
and float32 fields), leaves every other column and every other slot as it was, and
marks the slot for the next staged write."""
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphtap.engine.slots import SlotBlock, SlotLayout

FIELD = st.tuples(
    st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
    st.sampled_from([torch.int32, torch.float32]),
    st.booleans())  # fill along the last dimension


def _layout(specs, fills) -> SlotLayout:
    layout = SlotLayout()
    for (shape, dtype, along), fill in zip(specs, fills):
        f = tuple(float(fill + i) for i in range(shape[-1])) if along else float(fill)
        layout.reserve(shape, dtype, f)
    return layout


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(FIELD, min_size=1, max_size=6), data=st.data())
def test_reset_restores_only_its_fields(specs, data):
    fills = data.draw(st.lists(st.integers(-3, 3), min_size=len(specs), max_size=len(specs)))
    layout = _layout(specs, fills)
    block = SlotBlock(layout, slots=5, device=torch.device("cpu"))
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    block.host[:] = rng.integers(-100, 100, block.host.shape, dtype=np.int32)
    before = block.host.copy()
    chosen = data.draw(st.lists(st.sampled_from(layout.fields), unique=True))
    slot = data.draw(st.integers(0, 4))
    expected = before.copy()
    for f in chosen:  # the reference: one field at a time through its typed view
        view = expected if f.dtype == torch.int32 else expected.view(np.float32)
        view[:, f.offset:f.offset + f.size].reshape(5, *f.shape)[slot] = f.fill
    for _ in range(2):  # the second time from the remembered row
        block.host[:] = before
        block._dirty.clear()
        block.reset(slot, chosen)
        np.testing.assert_array_equal(block.host, expected)
        assert block._dirty == {slot}
