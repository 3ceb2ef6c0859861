"""CPU micro-benchmarks of a capturing step's host path (issue 18): what a burst's first
step (request 0 alone, its prompt) costs graphtap on the host before and after the
forward, which the engine's next admissions wait for on a GPU server.

Run: `make bench` (or `pytest benchmarks/cpu --benchmark-only`).
"""
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from test_bench_ops import batch as ops_batch

from graphtap.courier.pack import unpack
from graphtap.engine.families.capture import CaptureFamily
from graphtap.engine.families.steer import SteerFamily
from graphtap.engine.families.vectors import VectorBank
from graphtap.engine.router import TokenRouter
from graphtap.engine.tables import Sizes, allocate
from graphtap.engine.wanted import Wants, WantTable
from graphtap.ops.backend import TORCH
from graphtap.spec import CaptureEntry, NormalisedSpec
from graphtap.spec.sites import SiteTable, expand_patterns

H, L, PROMPT = 4096, 2048, 256
HS = (8, 16, 24)  # hs: Llama-3-8B's resid_post at 3 layers, last prompt token


def batch(reqs: int, tokens: int, computed: int):
    """test_bench_ops' step batch with the host view of positions vLLM's V2 input batch
    gives (no drafts): `computed` tokens of each request before the step."""
    b = ops_batch(reqs, tokens)
    b.idx_mapping_np = b.idx_mapping.numpy()
    b.num_computed_tokens_np = np.full(reqs, computed, np.int32)
    b.positions = torch.arange(b.num_tokens) % tokens + computed
    b.input_ids = torch.zeros(b.num_tokens, dtype=torch.int64)
    return b


@pytest.mark.parametrize("reqs", [1, 8, 16, 64])
@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_want_bound(benchmark, reqs, step):
    """A row family's step plan (WantTable.bound) in the step after an admission (its
    arrays rebuilt): every request of the batch captures 3 sites at its last prompt
    token; prefill: each request's 256-token prompt, decode: one token past it. The
    bound is computed in plain Python over the rows before their last wanted position
    where they are at most 16 (all of decode's are past it), else in one numpy pass."""
    table = WantTable(L)
    for slot in range(reqs):
        wants = Wants(L)
        wants.add("last_prompt", PROMPT, len(HS))
        table.set(slot, wants)
    b = batch(reqs, PROMPT, 0) if step == "prefill" else batch(reqs, 1, PROMPT + 4)

    def after_admission():
        table._flat = None
        return table.bound(b)

    assert benchmark(after_admission) == (reqs * len(HS) if step == "prefill" else 0)


@pytest.mark.parametrize("reqs", [16, 32, 64])
def test_want_bound_in_a_burst(benchmark, reqs):
    """The plan of a burst's later step (8 requests admitted per 2048-token step): the
    8 newest requests' prompts beside `reqs` - 8 earlier ones decoding past their last
    prompt token, every one capturing 3 sites there, the table's arrays rebuilt (an
    admission). The decoding rows are told apart by their slot's end, so only the new
    prompts are counted (before: the numpy pass over the whole batch past 16)."""
    table = WantTable(L)
    for slot in range(reqs):
        wants = Wants(L)
        wants.add("last_prompt", PROMPT, len(HS))
        table.set(slot, wants)
    b = batch(reqs, 1, PROMPT + 1)
    b.num_scheduled_tokens[-8:] = PROMPT
    b.num_computed_tokens_np[-8:] = 0

    def after_admission():
        table._flat = None
        return table.bound(b)

    assert benchmark(after_admission) == 8 * len(HS)


class NoRouting:
    """The device routing, replayed from CUDA graphs on a GPU (a few launches): left
    out here, where the torch reference would run the routing itself on the CPU; the
    step's rows and labels stay where the real routing put them before the runs."""

    def route_rows(self, tables, input_batch, max_len) -> None:
        pass


def test_first_capture_step(benchmark):
    """graphtap's host path of a burst's first step: an hs request (3 last-prompt
    sites) admitted into the steering and capture families, its slot's staged writes
    applied, the step planned and its rows' attribution set, the 3 rows snapshot and
    split into the request's payload, the request removed again."""
    sites = SiteTable(expand_patterns([f"blocks.{layer}.hook_resid_post" for layer in HS], 32))
    et = allocate(Sizes(max_reqs=256, max_tokens=2048, max_len=L, num_sites=len(sites),
                        hidden=H, steer_width=H, dtype=torch.bfloat16, max_steers=8,
                        max_vectors=64, max_captures=16, capture_rows=3 * 2048,
                        capture_width=H, pattern_rows=16, num_heads=32, patterns=False),
                  TORCH, torch.device("cpu"))
    steer = SteerFamily(et, sites, VectorBank(et.ops.steer))
    cap = CaptureFamily(et.ops.capture, et.capture, et.slots, widths={"resid_post": (H, 0)},
                        backend=TORCH, sites=sites, max_len=L, model_dtype=torch.bfloat16)
    spec = NormalisedSpec(capture=tuple(
        CaptureEntry(layer, "resid_post", f"blocks.{layer}.hook_resid_post", "model", None,
                     "last_prompt") for layer in HS))
    b = batch(1, PROMPT, 0)

    def step(router=NoRouting()):
        for family in (steer, cap):
            family.add_request(0, "r0", PROMPT, spec)
        et.slots.apply()
        steer.apply_staged_writes()
        plan = cap.plan(b)
        assert not steer.plan(b)
        cap.route(b, router, plan)
        out = cap.snapshot().per_request()
        for family in (steer, cap):
            family.remove_request("r0")
        et.slots.apply()
        return out

    router = TokenRouter(et.ops)
    router.route(b)
    assert list(step(router)) == ["r0"]  # labels the 3 rows as the device does
    out = benchmark(step)
    assert unpack(out["r0"])["blocks.16.hook_resid_post"].shape == (1, H)


def engine_hooks(max_len: int = L):
    """The worker's hook manager as the runner builds it (every family a default
    hook_config makes: steering, captures, probes), for a Llama-3-8B shape on CPU
    tables, with the benchmark's sites (a steering layer, hs's 3, qk's 4 layers x q, k),
    and the frontend that turns a request's hooks into their wire form."""
    from graphtap.testing.hook_manager import cpu_hook_manager

    sites = sorted({f"blocks.{layer}.hook_resid_post" for layer in (*HS, 16)} |
                   {f"blocks.{layer}.attn.hook_{k}" for layer in (4, 8, 16, 24) for k in "qk"})
    return cpu_hook_manager(sites, layers=32, hidden=H, heads=32, kv_heads=8, head_dim=128,
                            max_len=max_len, max_num_seqs=256, batched_tokens=2048,
                            dtype=torch.bfloat16, graph_tokens=512, max_captures=16,
                            capture_rows=3 * 2048)


MODES = {"plain": None,
         "steer": {"steer": [{"site": "blocks.16.hook_resid_post", "op": "add", "scale": 1.0,
                              "vector": [0.25] * H, "positions": "all"}]},
         "hs": {"capture": [{"site": f"blocks.{layer}.hook_resid_post",
                             "positions": "last_prompt"} for layer in HS]},
         "qk": {"capture": [c for layer in (4, 8, 16, 24) for c in (
             {"site": f"blocks.{layer}.attn.hook_q", "positions": "last_prompt",
              "heads": [0, 1, 2, 3]},
             {"site": f"blocks.{layer}.attn.hook_k", "positions": "prompt",
              "heads": [0, 1, 2, 3]})]}}


def admission(benchmark, mode: str, max_len: int, rounds: int):
    """Times 32 requests of `mode` added to the hook manager and the step's staged writes
    applied (removed again before each round, untimed); the manager."""
    from vllm import SamplingParams

    manager, frontend = engine_hooks(max_len)
    params = SamplingParams(max_tokens=8, hooks=MODES[mode])
    frontend.process_request("x", params, None, PROMPT)  # its wire form, as the engine gets it
    reqs = [NS(req_id=f"r{i}", prompt_len=PROMPT, sampling_params=params) for i in range(32)]

    def admit():
        for i, r in enumerate(reqs):
            manager.add_request(i, r)
        manager.apply_staged_writes()

    def removed():
        for r in reqs:
            manager.remove_request(r.req_id)
        manager.apply_staged_writes()
        return (), {}

    benchmark.pedantic(admit, setup=removed, rounds=rounds)
    return manager


@pytest.mark.parametrize("mode", list(MODES))
def test_admission_step(benchmark, mode):
    """The worker's part of a burst's admission step: 32 requests added to the hook
    manager (every family) and the step's staged writes applied (then removed again,
    untimed). plain: requests without hooks; steer: bench_tpot's steering (one 4096-wide
    vector, every position; the vector resident after the first); hs: 3 last-prompt
    residual captures. Per request: the figure / 32; the difference is what a hooked
    request's first token waits for beyond a plain one's."""
    manager = admission(benchmark, mode, L, rounds=200)
    assert manager.stats()["capture"]["requests"] == (32 if mode in ("hs", "qk") else 0)
    assert manager.stats()["steer"]["requests"] == (32 if mode == "steer" else 0)


@pytest.mark.parametrize("mode", ["hs", "steer"])
@pytest.mark.parametrize("max_len", [2048, 32768, 131072])
def test_admission_step_long_context(benchmark, max_len, mode):
    """test_admission_step's hs and steer admissions at longer max_model_len: a slot's
    row holds every entry's position bitmap (max_len / 32 words each), so a request
    whose staged write copied its whole row (to the pinned staging ring on the host,
    then through UVA to the device) cost more the longer max_model_len, though an hs
    request's bitmaps hold one set bit each and a steering request sets one entry; the
    columns they set alone (SlotBlock.stage_runs) do not."""
    manager = admission(benchmark, mode, max_len, rounds=20)
    benchmark.extra_info["slot_row_bytes"] = manager.slots.host.shape[1] * 4
    assert manager.stats()["capture" if mode == "hs" else "steer"]["requests"] == 32
