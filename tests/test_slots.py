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
        block.reset(slot, block.group(chosen))
        np.testing.assert_array_equal(block.host, expected)
        assert block._dirty == {slot}


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["claim", "release",
                                                                    "rewrite", "apply"])),
                    max_size=30))
def test_claims_and_releases_keep_the_device_equal_to_the_host(ops):
    """A family's resets as requests come and go (claim: it writes entries next; release:
    the request holds none; rewrite: always, the probe ring's way): after every staged
    write the device holds what the host does, a released slot is inactive, and a
    release of a slot known inactive stages nothing (a plain request's admission costs
    no row copy)."""
    layout = SlotLayout()
    site = layout.reserve((2,), torch.int32, -1.0)
    coef = layout.reserve((2, 3), torch.float32, (1.0, 0.0, 5.0))
    fields = [site, coef]
    block = SlotBlock(layout, slots=4, device=torch.device("cpu"))
    inactive = block.host[0].copy()
    rng = np.random.default_rng(len(ops))
    known_inactive = [True] * 4  # the test's own account: released since last written
    for slot, op in ops:
        if op == "apply":
            block.apply()
            assert np.array_equal(block.gpu.numpy(), block.host)
            continue
        staged = set(block._dirty)
        claim = {"claim": True, "release": False, "rewrite": None}[op]
        block.reset(slot, block.group(fields), claim)
        if op == "release":
            assert np.array_equal(block.host[slot], inactive)
            if known_inactive[slot]:
                assert block._dirty == staged  # nothing written, nothing staged
        else:
            assert slot in block._dirty
            if op == "claim":
                assert np.array_equal(block.host[slot], inactive)
                block.host_view(site)[slot] = rng.integers(0, 9, 2)  # its entries
                block.host_view(coef)[slot] = rng.normal(size=(2, 3))
        known_inactive[slot] = op == "release"
    block.apply()
    assert np.array_equal(block.gpu.numpy(), block.host)


def test_a_plain_request_stages_no_row_where_the_slot_is_inactive():
    """Releasing a slot twice stages it once; claiming a clean slot stages it without
    rewriting it; a rewrite (None) always stages."""
    layout = SlotLayout()
    f = layout.reserve((3,), torch.int32, -1.0)
    block = SlotBlock(layout, slots=2, device=torch.device("cpu"))
    block.reset(1, block.group([f]), claim=False)
    assert not block._dirty  # never used: nothing to write
    block.reset(1, block.group([f]), claim=True)
    block.host_view(f)[1] = (4, 5, 6)
    assert block._dirty == {1}
    block.apply()
    block.reset(1, block.group([f]), claim=False)
    assert block._dirty == {1} and block.host_view(f)[1].tolist() == [-1, -1, -1]
    block.apply()
    block.reset(1, block.group([f]), claim=False)
    assert not block._dirty
    block.reset(1, block.group([f]), claim=None)
    assert block._dirty == {1}
    block.apply()
    assert block.gpu.tolist() == block.host.tolist() == [[-1, -1, -1]] * 2


@settings(max_examples=40, deadline=None)
@given(depth=st.integers(2, 4),
       steps=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6), max_size=12))
def test_staged_rows_stay_put_until_the_device_may_have_read_them(depth, steps):
    """Each apply stages its rows in the next of `depth` host buffers, which the device
    reads when it runs the step, up to depth - 1 steps later: what an apply staged is
    still there, unchanged, through the next depth - 1 applies, whatever they write;
    and after every apply the device block equals the host's."""
    layout = SlotLayout()
    f = layout.reserve((3,), torch.int32, -1.0)
    block = SlotBlock(layout, slots=6, device=torch.device("cpu"), staging_depth=depth)
    staged = []  # (index view, values view, what they held when staged)
    for n, slots in enumerate(steps):
        for slot in slots:
            block.reset(slot, block.group([f]), claim=True)
            block.host_view(f)[slot] = (n, slot, n * slot)
        rows = sorted(set(slots))
        index, values = block.staging.views(*block.staging.stage(np.array(rows), block.host))
        staged.append((index, values, index.clone(), values.clone()))
        assert index.tolist() == rows and values.tolist() == block.host[rows].tolist()
        block._dirty.clear()
        block.gpu.index_copy_(0, index, values)
        assert np.array_equal(block.gpu.numpy(), block.host)
        for index, values, was_index, was_values in staged[-depth:]:
            assert torch.equal(index, was_index) and torch.equal(values, was_values)
    for slot in range(6):  # apply() goes the same way
        block.reset(slot, block.group([f]), claim=None)
    block.apply()
    assert np.array_equal(block.gpu.numpy(), block.host)
