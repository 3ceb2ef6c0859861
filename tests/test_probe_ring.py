"""The probe ring (engine/ring.py): generated positions' scores written on
the device by the probe op instead of routed rows, read by the host when the request may
finish or its ring fills. The op (torch reference and Triton kernel alike), the step
plan (which steps route, which leave it to the ring), the reads, rows routed in mixed
steps taken once, and an overwritten ring failing the request instead of shortening it."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from graphtap.courier import StepSnapshots
from graphtap.courier.chunks import ERROR, HELD, error_message
from graphtap.courier.held import Ending, StepBatch
from graphtap.engine.families.probe import RING_STEP, ProbeFamily
from graphtap.engine.families.vectors import VectorBank
from graphtap.engine.router import TokenRouter
from graphtap.ops.backend import TORCH
from graphtap.ops.probe import probe_reference
from graphtap.spec import ModelShape, normalise, parse_site, parse_spec
from graphtap.spec.sites import SiteTable
from helpers import engine_tables

H, R, N, L, C, P, G = 32, 3, 24, 64, 2, 2, 16
SITE = "blocks.1.hook_resid_post"
NAME = f"probe:{SITE}"
SHAPE = ModelShape(num_layers=2, hidden_size=H, max_model_len=L, max_steers=2, max_vectors=4,
                   max_probes=C, probe_width=P,
                   configured_sites={"blocks.0.hook_resid_post", SITE})
X = torch.randn(L, H, generator=torch.Generator().manual_seed(3))  # the stream at each position
W = torch.randn(2, H, generator=torch.Generator().manual_seed(4))
BIAS = [0.5, -1.0]


def test_kernel_and_reference_fill_the_ring_alike():
    """Tokens routed nowhere whose entry wants their position, at or past their slot's
    ring_from, write [slot, entry, position % G] and its label; nothing else does."""
    from graphtap.ops.probe_triton import probe_triton

    def tables():
        et = engine_tables(max_reqs=R, max_tokens=N, max_len=L, hidden=H, num_sites=2,
                           max_vectors=4, max_probes=C, probe_width=P, probe_rows=4,
                           probe_ring=G)
        t, bank = et.ops.probe, et.ops.steer.bank
        bank[1:3] = W
        t.entry_site[0, 1], t.entry_site[1, 0] = 1, 1
        t.entry_vec[0, 1] = t.entry_vec[1, 0] = torch.tensor([1, 2], dtype=torch.int32)
        t.entry_bias[0, 1] = torch.tensor(BIAS)
        t.entry_pos[0, 1] = -1  # every position
        t.entry_pos[1, 0, 0] = 0b1010 << 8  # slot 1: positions 9 and 11
        t.ring_from[0], t.ring_from[1] = 6, 4
        t.dst[1, 1] = 0  # token 1 (slot 0) routed: its buffer row, not the ring
        return t, bank

    tok_slot = torch.tensor([0, 0, 0, 1, 1, 1, 3, 0])
    pos = torch.tensor([6, 7, 5, 9, 10, 11, 0, 8 + G])
    x = X[:8]
    ref, bank = tables()
    tri, _ = tables()
    probe_reference(ref, bank, tok_slot, x, None, pos, 1)
    probe_triton(tri, bank, tok_slot, x, None, pos, 1)
    score = x @ W.T
    for t in (ref, tri):
        labels = t.ring_pos[:R]
        assert (labels >= 0).sum() == 4  # 6, 8 + G, 9, 11; not 5, 7 (routed), 10
        assert labels[0, 1, 6] == 6 and labels[0, 1, 8] == 8 + G
        assert labels[1, 0, 9] == 9 and labels[1, 0, 11] == 11
        torch.testing.assert_close(t.ring[0, 1, 8], score[7] + torch.tensor(BIAS))
        torch.testing.assert_close(t.ring[1, 0, 11], score[5])
        torch.testing.assert_close(t.buf[0], score[1] + torch.tensor(BIAS))
    torch.testing.assert_close(ref.ring[:R], tri.ring[:R])
    assert torch.equal(ref.ring_pos[:R], tri.ring_pos[:R])


class Engine:
    """One probe family on CPU engine tables, run step by step like the manager does."""

    def __init__(self, ring=G):
        self.et = engine_tables(max_reqs=R, max_tokens=N, max_len=L, hidden=H, num_sites=2,
                                max_vectors=6, max_probes=C, probe_width=P, probe_rows=32,
                                probe_ring=ring)
        sites = SiteTable([parse_site("blocks.0.hook_resid_post", 2), parse_site(SITE, 2)])
        self.fam = ProbeFamily(self.et.ops.probe, self.et.probe, self.et.slots, backend=TORCH,
                               sites=sites, max_len=L, model_dtype=torch.float32,
                               bank=VectorBank(self.et.ops.steer))
        self.router = TokenRouter(self.et.ops)
        self.computed: dict[str, int] = {}
        self.slot: dict[str, int] = {}
        self.plans = []

    def add(self, req, slot, prompt_len, positions="all", stop=7, guard=None,
            every_step=False):
        spec = {"probe": [{"site": SITE, "weights": W.tolist(), "bias": BIAS,
                           "positions": positions}]}
        if guard:
            spec["guard"] = guard
        self.fam.add_request(slot, req, prompt_len, normalise(parse_spec(spec), SHAPE))
        self.fam.hold(req, Ending(frozenset({stop}), cap=L, every_step=every_step))
        self.computed[req], self.slot[req] = 0, slot
        self.et.slots.apply()
        self.fam.apply_staged_writes()

    def batch(self, tokens: dict[str, int]):
        """The step's input batch as the runner hands it (`tokens` per request)."""
        reqs = list(tokens)
        counts = np.array([tokens[r] for r in reqs])
        computed = np.array([self.computed[r] for r in reqs])
        pos = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, counts)])
        n = len(pos)
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        slots = np.array([self.slot[r] for r in reqs])
        batch = SimpleNamespace(
            req_ids=reqs, num_reqs=len(reqs), num_tokens=n, num_tokens_after_padding=n + 2,
            query_start_loc=torch.from_numpy(qsl), query_start_loc_np=qsl,
            idx_mapping=torch.from_numpy(slots), idx_mapping_np=slots,
            num_computed_tokens_np=computed, num_scheduled_tokens=counts,
            positions=torch.cat([pos, torch.zeros(2, dtype=torch.long)]))
        return batch, pos

    def step(self, tokens: dict[str, int], sampled: dict[str, int], read=True):
        """One step: `tokens` scheduled per request, then `sampled` per request."""
        batch, pos = self.batch(tokens)
        plan = self.fam.plan(batch)
        self.plans.append(plan)
        if plan:
            self.router.route(batch)
            self.fam.route(batch, self.router, plan)
        else:
            self.router.deactivate()
            self.fam.deactivate()
        x = torch.cat([X[pos], torch.full((2, H), float("nan"))])  # padding: garbage
        probe_reference(self.et.ops.probe, self.et.ops.steer.bank, self.et.ops.tok_slot, x,
                        None, batch.positions, 1)
        for r, k in tokens.items():
            self.computed[r] += k
        part = self.fam.snapshot()
        if part is None or not read:
            return {}
        part.to_cpu_nonblocking()
        step = SimpleNamespace(req_ids=list(sampled), sampled_token_ids=[[t] for t in
                                                                         sampled.values()])
        return StepSnapshots([part], batch=StepBatch.of(batch)).chunks(step)


def want(positions):
    return X[positions] @ W.T + torch.tensor(BIAS)


def test_decoding_fills_the_ring_and_goes_home_once():
    """Prefill routes rows (prompt positions); decode steps route nothing (RING_STEP);
    the ring is read when half full and when the stop token comes; the one chunk holds
    every position once, in order, each score its formula's."""
    e = Engine()
    e.add("a", 1, prompt_len=5)
    got = e.step({"a": 5}, {"a": 3})
    assert e.plans[-1] == 5 and not got
    for _ in range(20):
        got = e.step({"a": 1}, {"a": 3})
        assert e.plans[-1] is RING_STEP and not got
    assert e.fam.ring._reqs["a"].start > 5  # read once it reached half the ring
    got = e.step({"a": 1}, {"a": 7})["a"]
    assert got[f"{NAME}@positions"].tolist() == list(range(26)) and got[HELD].tolist() == [26]
    torch.testing.assert_close(got[NAME], want(list(range(26))), atol=1e-5, rtol=1e-5)
    assert e.fam.stats()["held_bytes"] == 0


def test_mixed_steps_route_and_the_ring_leaves_them_to_the_rows():
    """A decode step beside a prefill that wants its prompt routes everything: that
    position comes as a row, and the ring read takes the others without repeating it."""
    e = Engine()
    e.add("a", 0, prompt_len=3, positions="generated")
    e.step({"a": 3}, {"a": 3})
    e.step({"a": 1}, {"a": 3})
    assert e.plans[-1] is RING_STEP
    e.add("b", 2, prompt_len=6)
    e.step({"a": 1, "b": 6}, {"a": 3, "b": 3})
    assert isinstance(e.plans[-1], int) and e.plans[-1] == 7
    e.step({"a": 1, "b": 1}, {"a": 3, "b": 3})
    assert e.plans[-1] is RING_STEP
    got = e.step({"a": 1, "b": 1}, {"a": 7, "b": 7})
    assert got["a"][f"{NAME}@positions"].tolist() == [3, 4, 5, 6]  # 4 came as a row
    assert got["b"][f"{NAME}@positions"].tolist() == list(range(8))
    torch.testing.assert_close(got["a"][NAME], want([3, 4, 5, 6]), atol=1e-5, rtol=1e-5)


def test_big_steps_and_stopping_guards_route_rows():
    """A step running more than a quarter of the ring for one request past its prompt
    (a recomputation) routes; so does every step of a request whose probe guard stops."""
    e = Engine()
    e.add("a", 0, prompt_len=2)
    e.step({"a": 2}, {"a": 3})
    e.step({"a": G // 4 + 1}, {"a": 3})
    assert isinstance(e.plans[-1], int)
    e.add("g", 1, prompt_len=2, guard={"kind": "probe", "threshold": 1e9, "action": "stop"})
    e.step({"a": 1, "g": 2}, {"a": 3, "g": 3})
    e.step({"a": 1, "g": 1}, {"a": 3, "g": 3})
    assert isinstance(e.plans[-1], int) and e.plans[-1] == 2
    got = e.step({"a": 1, "g": 1}, {"a": 7, "g": 7})
    assert got["a"][f"{NAME}@positions"].tolist() == list(range(2 + G // 4 + 4))
    assert got["g"][f"{NAME}@positions"].tolist() == [0, 1, 2, 3]


def test_requests_that_go_home_every_step_route_rows():
    """Stop strings make every step one that may finish the request: its rows go home
    each step, so they are routed rows (a ring read per step would cost more), and each
    step's chunk holds that step's positions once."""
    e = Engine()
    e.add("s", 1, prompt_len=3, positions="generated", every_step=True)
    assert not e.fam.ring.holds("s") and e.et.ops.probe.ring_from[1, 0] != 3
    e.step({"s": 3}, {"s": 3})
    got = [e.step({"s": 1}, {"s": 3})["s"] for _ in range(3)]
    assert all(isinstance(p, int) and p == 1 for p in e.plans[1:])
    assert [g[f"{NAME}@positions"].tolist() for g in got] == [[3], [4], [5]]
    torch.testing.assert_close(torch.cat([g[NAME] for g in got]), want([3, 4, 5]),
                               atol=1e-5, rtol=1e-5)


def test_requests_finishing_together_are_read_in_shared_fetches():
    """A batch that finishes at one step reads every request's ring at that step:
    their slots are fetched together (up to the fetch's size at once, 2 here, so 3
    requests take 2 fetches, not 3 waits), each request's rows its own and whole, also
    for a request whose positions partly came as routed rows."""
    e = Engine()
    e.fam.ring._chunk = 2
    for slot, req in enumerate("abc"):
        e.add(req, slot, prompt_len=3 + slot)
    e.step({"a": 3, "b": 4, "c": 5}, {"a": 3, "b": 3, "c": 3})
    e.step({"a": 1, "b": 1, "c": 5}, {"a": 3, "b": 3, "c": 3})  # c's 5: routed rows
    for _ in range(4):
        e.step({"a": 1, "b": 1, "c": 1}, {"a": 3, "b": 3, "c": 3})
    before = e.fam.stats()
    got = e.step({"a": 1, "b": 1, "c": 1}, {"a": 7, "b": 7, "c": 7})
    after = e.fam.stats()
    assert after["ring_reads_total"] - before["ring_reads_total"] == 3
    assert after["ring_fetches_total"] - before["ring_fetches_total"] == 2
    for req, n in (("a", 3 + 6), ("b", 4 + 6), ("c", 5 + 5 + 5)):
        assert ERROR not in got[req]
        assert got[req][f"{NAME}@positions"].tolist() == list(range(n)), req
        torch.testing.assert_close(got[req][NAME], want(list(range(n))), atol=1e-5,
                                   rtol=1e-5)


def test_an_overwritten_ring_fails_the_request_rather_than_shortening_it():
    """Steps whose results nobody read (the reads are skipped here) wrap the ring: the
    labels show it, and the request gets an error naming probe_ring, never fewer rows."""
    e = Engine()
    e.add("a", 0, prompt_len=2)
    e.step({"a": 2}, {"a": 3})
    for _ in range(G + 2):
        e.step({"a": 1}, {"a": 3}, read=False)
    got = e.step({"a": 1}, {"a": 7})["a"]
    assert "probe_ring" in error_message(got[ERROR]), error_message(got[ERROR])


@pytest.mark.parametrize("ring", [16, 64])
def test_every_length_comes_home_whole(ring):
    """Whatever the ring size and however many decode steps, the stop step's chunk holds
    prompt and generated positions once each."""
    e = Engine(ring)
    e.add("a", 2, prompt_len=4)
    e.step({"a": 4}, {"a": 3})
    steps = 40
    for i in range(steps):
        got = e.step({"a": 1}, {"a": 7 if i == steps - 1 else 3})
    assert got["a"][f"{NAME}@positions"].tolist() == list(range(4 + steps))
    torch.testing.assert_close(got["a"][NAME], want(list(range(4 + steps))), atol=1e-5,
                               rtol=1e-5)


def test_the_one_pass_plan_agrees_with_the_want_table():
    """Random batches of requests with random position rules, prompts and guards: where
    the plan decides in its one pass over per-slot arrays (ring or nothing), the want
    table decides the same (or finds nothing to route at all)."""
    from graphtap.engine.wanted import batch_windows

    rng = np.random.default_rng(1)
    rules = ["all", "generated", "prompt", "last_prompt", [1, 3], {"start": 2, "end": 20}]
    stop = {"kind": "probe", "threshold": 1e9, "action": "stop"}
    shortcuts = 0
    for trial in range(150):
        e = Engine()
        tokens = {}
        for slot in rng.permutation(R)[:int(rng.integers(1, R + 1))].tolist():
            req = f"r{slot}"
            prompt = int(rng.integers(2, 10))
            rule = rules[int(rng.integers(len(rules)))]
            guarded = rule in ("all", "generated") and rng.random() < 0.3  # guards need them
            e.add(req, slot, prompt, positions=rule, guard=stop if guarded else None)
            e.computed[req] = int(rng.integers(0, 30))
            tokens[req] = int(rng.integers(1, 3)) if rng.random() < 0.7 else \
                int(rng.integers(1, 9))
        batch, _ = e.batch(tokens)
        fast, slow = e.fam.plan(batch), e.fam.plan_rows(batch, batch_windows(batch))
        shortcuts += fast is RING_STEP or fast == 0
        assert fast == slow or (fast is RING_STEP and slow == 0), (trial, fast, slow)
    assert shortcuts > 30


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, R - 1),
                              st.sampled_from(["probe", "every_step", "plain", "remove",
                                               "apply"])), max_size=25))
def test_the_device_block_follows_probe_and_plain_requests(ops):
    """Probe requests (the ring writes where each one's ring starts), probe requests
    whose rows go home every step (taken off the ring), plain requests and removals,
    in any order over a few slots: after every staged write the device block equals
    the host's, a slot without a probe request holds every field's inactive value
    (ring_from: never), and a plain request on a slot known inactive stages nothing."""
    e = Engine()
    fam, slots = e.fam, e.et.slots
    inactive = slots.host[0].copy()
    spec = normalise(parse_spec({"probe": [{"site": SITE, "weights": W.tolist(),
                                            "positions": "all"}]}), SHAPE)
    live: dict[int, str] = {}  # slot -> its request, if any
    probing: set[int] = set()
    for n, (slot, op) in enumerate(ops):
        if op == "apply":
            slots.apply()
            assert np.array_equal(slots.gpu.numpy(), slots.host)
            continue
        if slot in live:
            fam.remove_request(live.pop(slot))
            probing.discard(slot)
        staged = set(slots._dirty)
        if op in ("probe", "every_step"):
            live[slot] = f"r{n}"
            fam.add_request(slot, f"r{n}", 5, spec)
            fam.hold(f"r{n}", Ending(frozenset({7}), cap=L, every_step=op == "every_step"))
            probing.add(slot)
            assert fam.ring.holds(f"r{n}") == (op == "probe")
        elif op == "plain":
            live[slot] = f"r{n}"
            fam.add_request(slot, f"r{n}", 5, normalise(parse_spec({}), SHAPE))
            assert slots._dirty == staged  # removed before, or never used: inactive
        for s in range(R):
            if s not in probing:
                assert np.array_equal(slots.host[s], inactive)
    slots.apply()
    assert np.array_equal(slots.gpu.numpy(), slots.host)
