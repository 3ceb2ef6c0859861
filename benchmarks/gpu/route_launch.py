"""Host time of a capturing step's per-step work on this machine, without an engine: the
step plan, the token routing and the row routing (their Triton launches and fills, or
the replay of their CUDA graphs: engine/route_graphs.py), and the snapshot's clones, for
a prefill step of 8 requests x 256 tokens capturing 3 sites at the last prompt position
(bench_tpot's hs), each timed over many calls with one device sync at the end; and the
device time of the row routing's kernels (CUDA events), whose fit scan is one program
over every request slot. With and without the routing graphs, in one launch; and
before timing, the graphed routing of random batches against the torch reference.
Needs torch, Triton and, on a GPU, vLLM (the UVA view the routing graphs read the layout
through):

    bash benchmarks/gpu/run_gpu.sh routelaunch   (ROUTE_ARGS="--max-reqs 64,1024")
    PYTHONPATH=overlay python3 -m benchmarks.gpu.route_launch   (on the CPU)

Prints one JSON line per (max_reqs, sites, graphs), then the check's line.
"""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np
import torch

from graphtap.engine.families.capture import CaptureFamily
from graphtap.engine.router import TokenRouter
from graphtap.engine.tables import Sizes, allocate
from graphtap.ops.backend import select_backend
from graphtap.spec import CaptureEntry, NormalisedSpec
from graphtap.spec.sites import SiteTable, expand_patterns

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a smoke run


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def batch(reqs: int, tokens: int) -> SimpleNamespace:
    n = reqs * tokens
    qsl = np.arange(0, n + 1, tokens, dtype=np.int32)
    return SimpleNamespace(
        req_ids=[f"r{i}" for i in range(reqs)], num_reqs=reqs, num_tokens=n,
        num_tokens_after_padding=n, query_start_loc_np=qsl,
        query_start_loc=torch.from_numpy(qsl).to(DEV),
        idx_mapping=torch.arange(reqs, dtype=torch.int32, device=DEV),
        idx_mapping_np=np.arange(reqs, dtype=np.int32),
        num_computed_tokens_np=np.zeros(reqs, np.int32),
        num_scheduled_tokens=np.full(reqs, tokens),
        positions=(torch.arange(n, device=DEV) % tokens))


def host_us(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    sync()
    return round(host, 1)


def device_us(fn, n: int = 100) -> float | None:
    if DEV.type != "cuda":
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / n * 1000, 1)


def engine(max_reqs: int, num_sites: int, backend, graphs: bool):
    sites = SiteTable(expand_patterns(["blocks.*.hook_resid_post"], num_sites))
    et = allocate(Sizes(max_reqs=max_reqs, max_tokens=2048, max_len=4096,
                        num_sites=len(sites), hidden=4096, steer_width=4096,
                        dtype=torch.bfloat16, max_steers=4, max_vectors=8, max_captures=4,
                        capture_rows=8192, capture_width=4096, pattern_rows=16,
                        num_heads=32, patterns=False), backend, DEV)
    cap = CaptureFamily(et.ops.capture, et.capture, et.slots,
                        widths={"resid_post": (4096, 0)}, backend=backend, sites=sites,
                        max_len=4096, model_dtype=torch.bfloat16)
    router = TokenRouter(et.ops)
    if graphs:
        router.capture_graphs([et.ops.capture], 4096)
        assert DEV.type != "cuda" or router.graphs is not None
    return et, cap, router


def check(max_reqs: int = 64, cases: int = 200, seed: int = 0) -> dict:
    """Random batches (1-8 requests of 1-300 tokens, padding, positions from a random
    start; requests capturing 3 of 32 sites at every, the last prompt or the generated
    positions) routed by the graphed Triton router and by the torch reference: the
    token map, every row's destination, the counts and labels equal."""
    from graphtap.ops.backend import TORCH

    rng = np.random.default_rng(seed)
    (gt, gcap, grouter), (rt, rcap, rrouter) = (engine(max_reqs, 32, select_backend(DEV), True),
                                                 engine(max_reqs, 32, TORCH, False))
    rules = ("all", "last_prompt", "generated")
    for slot in range(max_reqs):
        spec = NormalisedSpec(capture=tuple(
            CaptureEntry(layer, "resid_post", f"blocks.{layer}.hook_resid_post", "bfloat16",
                         None, rules[(slot + layer) % 3]) for layer in range(0, 32, 11)))
        for cap in (gcap, rcap):
            cap.add_request(slot, f"r{slot}", 200, spec)
    gt.slots.apply()
    rt.slots.apply()
    mismatches, rows = 0, 0
    for case in range(cases):
        reqs = int(rng.integers(1, 9))
        lengths = rng.integers(1, 301, reqs) if case % 4 else np.ones(reqs, int)
        qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        n = min(int(qsl[-1] + rng.integers(0, 16)), 2048)
        if qsl[-1] > n:
            continue
        slots = rng.choice(max_reqs, reqs, replace=False).astype(np.int32)
        pos = np.concatenate([s + np.arange(k) for s, k in
                              zip(rng.integers(0, 400, reqs), lengths)] + [np.zeros(n - qsl[-1], int)])
        b = SimpleNamespace(req_ids=[f"r{s}" for s in slots], num_reqs=reqs,
                            num_tokens=int(qsl[-1]), num_tokens_after_padding=n,
                            query_start_loc_np=qsl, query_start_loc=torch.from_numpy(qsl).to(DEV),
                            idx_mapping=torch.from_numpy(slots).to(DEV), idx_mapping_np=slots,
                            positions=torch.from_numpy(pos).to(DEV))
        for router, t in ((grouter, gt.ops.capture), (rrouter, rt.ops.capture)):
            router.route(b)
            router.route_rows(t, b, 4096)
        g, r = gt.ops.capture, rt.ops.capture
        used = min(int(r.count[0]), r.rows)
        same = (torch.equal(gt.ops.tok_slot[:n], rt.ops.tok_slot[:n])
                and torch.equal(g.dst[:, :n], r.dst[:, :n]) and torch.equal(g.count, r.count)
                and torch.equal(g.labels[:used], r.labels[:used]))
        mismatches += not same
        rows += used
    return {"check": "graphed routing vs torch reference", "cases": cases,
            "mismatches": mismatches, "rows_routed": rows}


def measure(max_reqs: int, num_sites: int, graphs: bool, reqs: int = 8,
            tokens: int = 256) -> dict:
    et, cap, router = engine(max_reqs, num_sites, select_backend(DEV), graphs)
    spec = NormalisedSpec(capture=tuple(
        CaptureEntry(layer, "resid_post", f"blocks.{layer}.hook_resid_post", "bfloat16", None,
                     "last_prompt") for layer in range(3)))
    for i in range(reqs):
        cap.add_request(i, f"r{i}", tokens, spec)
    et.slots.apply()
    b = batch(reqs, tokens)
    n = b.num_tokens_after_padding
    t = et.ops.capture

    def tokens_route():
        router.invalidate()
        router.route(b)

    def rows_route():
        router.route_rows(t, b, 4096)

    def step():
        plan = cap.plan(b)
        tokens_route()
        cap.route(b, router, plan)
        return cap.snapshot()

    step()
    sync()
    got = int(t.count[0])
    return {"max_reqs": max_reqs, "sites": num_sites, "graphs": router.graphs is not None,
            "rows_routed": got,
            "host_us": {"plan": host_us(lambda: cap.plan(b)), "route_tokens": host_us(tokens_route),
                        "route_rows": host_us(rows_route), "snapshot": host_us(cap.snapshot),
                        "step": host_us(step)},
            "device_us": {"route_rows": device_us(rows_route),
                          "route_tokens": device_us(tokens_route)}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-reqs", default="64,1024")
    ap.add_argument("--sites", default="32")
    args = ap.parse_args()
    result = check()
    print(json.dumps(result), flush=True)
    for r in (int(x) for x in args.max_reqs.split(",")):
        for s in (int(x) for x in args.sites.split(",")):
            for graphs in (False, True, False, True):  # paired, twice
                print(json.dumps(measure(r, s, graphs)), flush=True)
    return 1 if result["mismatches"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
