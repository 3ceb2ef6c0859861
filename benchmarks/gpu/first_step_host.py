"""Host time of a burst's first hooked step, piece by piece, without an engine (issue 18):
the step that admits request 0 runs alone and every later request of the burst waits
behind its host work, so each microsecond of graphtap's prepare_step, collect and
to_cpu there is one of every request's TTFT. For hs (3 residual rows of one request)
and qk (q at the last prompt token, k at every prompt token, 4 layers x 4 heads, Llama-3-8B
widths) at one request of 256 tokens: the whole step (plan, routing, snapshot, copies
queued) and each call in it, timed "cold" (one call after the host did other work for a
while, as a burst's first step comes after a quiet engine) and "warm" (a tight loop);
and the step that admits the request (admit_step_fold: its staged slot writes applied by
the routing's replay, against admit_step_copy: by their own index copy first).
Needs torch, Triton and, on a GPU, vLLM (the UVA view the routing graphs read the layout
through):

    bash benchmarks/gpu/run_gpu.sh firststep   (FIRST_ARGS="--samples 40 --label L")
    PYTHONPATH=overlay python3 -m benchmarks.gpu.first_step_host   (on the CPU)

Prints one JSON line per workload and writes $OUT/first-step-host.json as
{"device", "samples", "overlays": {label: [per workload]}} (what
benchmarks/results_readme.py renders): a run with another --label (another overlay on
PYTHONPATH, on the same device and samples) adds its column to the same file.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from benchmarks.gpu.host_info import gpu_name
from benchmarks.gpu.route_launch import DEV, sync
from benchmarks.gpu.route_launch import host_us as warm_us  # a tight loop
from graphtap.courier import StepSnapshots
from graphtap.engine.families.capture import CaptureFamily
from graphtap.engine.router import TokenRouter
from graphtap.engine.tables import Sizes, allocate
from graphtap.ops.backend import select_backend
from graphtap.spec import CaptureEntry, NormalisedSpec
from graphtap.spec.sites import SiteTable, expand_patterns

LAYERS, HIDDEN, HEAD_DIM, KV = 32, 4096, 128, 8
WIDTHS = {"resid_post": (HIDDEN, 0), "attn_q": (HIDDEN, HEAD_DIM),
          "attn_k": (KV * HEAD_DIM, HEAD_DIM)}


def specs() -> dict[str, NormalisedSpec]:
    heads = (0, 1, 2, 3)
    qk = tuple(e for layer in (4, 8, 16, 24) for e in (
        CaptureEntry(layer, "attn_q", f"blocks.{layer}.attn.hook_q", "model", heads,
                     "last_prompt"),
        CaptureEntry(layer, "attn_k", f"blocks.{layer}.attn.hook_k", "model", heads,
                     "prompt")))
    hs = tuple(CaptureEntry(layer, "resid_post", f"blocks.{layer}.hook_resid_post", "model",
                            None, "last_prompt") for layer in (8, 16, 24))
    return {"hs": NormalisedSpec(capture=hs), "qk": NormalisedSpec(capture=qk)}


# vLLM's positions buffer (the runner's): a step's positions are a prefix of it
RUNNER_POSITIONS = torch.arange(2048, device=DEV)


def batch(tokens: int, slot: int) -> SimpleNamespace:
    qsl = np.array([0, tokens], np.int32)
    return SimpleNamespace(
        req_ids=[f"r{slot}"], num_reqs=1, num_tokens=tokens, num_tokens_after_padding=tokens,
        query_start_loc_np=qsl, query_start_loc=torch.from_numpy(qsl).to(DEV),
        idx_mapping=torch.tensor([slot], dtype=torch.int32, device=DEV),
        idx_mapping_np=np.array([slot], np.int32),
        num_computed_tokens_np=np.zeros(1, np.int32),
        num_scheduled_tokens=np.array([tokens]), positions=RUNNER_POSITIONS[:tokens])


def engine(max_reqs: int = 64):
    sites = SiteTable(expand_patterns(["blocks.*.hook_resid_post", "blocks.*.attn.hook_q",
                                       "blocks.*.attn.hook_k"], LAYERS))
    backend = select_backend(DEV)
    et = allocate(Sizes(max_reqs=max_reqs, max_tokens=2048, max_len=4096,
                        num_sites=len(sites), hidden=HIDDEN, steer_width=HIDDEN,
                        dtype=torch.bfloat16, max_steers=4, max_vectors=8, max_captures=8,
                        capture_rows=16384, capture_width=HIDDEN, pattern_rows=16,
                        num_heads=32, patterns=False), backend, DEV)
    cap = CaptureFamily(et.ops.capture, et.capture, et.slots, widths=WIDTHS, backend=backend,
                        sites=sites, max_len=4096, model_dtype=torch.bfloat16)
    router = TokenRouter(et.ops, slots=et.slots)  # its replays apply the staged writes
    router.capture_graphs([et.ops.capture], 4096)
    router.learn_positions(RUNNER_POSITIONS[:1])  # as the engine's dummy steps
    router.adopt_positions()  # the graphs copy the positions: one replay a step
    return et, cap, router


_JUNK = np.zeros(8 << 20)  # 64 MiB the host walks between cold calls


def cold_us(fn, samples: int, quiet: float = 0.02) -> float:
    """Median host time of one call after the host did other work and slept (a burst's
    first step comes after the engine waited for requests)."""
    out = []
    for _ in range(samples):
        sync()
        # evicts the caches, as the frontend's and the engine's other work does
        np.add(_JUNK, 1.0, out=_JUNK)
        time.sleep(quiet)
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    sync()
    return round(statistics.median(out), 1)


def driver_launch():
    """cuGraphLaunch of a torch graph's executable, skipping torch's replay() (the
    comparison: how much of a replay is torch's own), or None."""
    if DEV.type != "cuda" or not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    launch = lib.cuGraphLaunch
    launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]

    def go(graph):
        exec_, stream = graph.raw_cuda_graph_exec(), torch.cuda.current_stream().cuda_stream
        return lambda: launch(exec_, stream)
    return go


def measure(name: str, spec: NormalisedSpec, samples: int) -> dict:
    et, cap, router = engine()
    slot, tokens = 3, 256
    cap.add_request(slot, f"r{slot}", tokens, spec)
    et.slots.apply()
    b = batch(tokens, slot)
    t = et.ops.capture
    steps = []

    def prepare():
        plan = cap.plan(b)
        router.invalidate()
        router.route(b, positions=True, rows=cap.rows_to_route(plan))
        cap.route(b, router, plan)

    def collect():
        part = cap.snapshot()
        steps.append(StepSnapshots([part]))

    def to_cpu():
        steps[-1].to_cpu_nonblocking()

    def finish():
        collect()
        to_cpu()
        if len(steps) > 4:
            steps.pop(0)

    def step():
        prepare()
        finish()

    def admit():  # the request again, into its slot: its row staged
        cap.remove_request(f"r{slot}")
        cap.add_request(slot, f"r{slot}", tokens, spec)

    def admit_step(fold: bool):
        """The engine's step with a new request: admission, the staged writes (applied
        in the routing's replay, or by their own index copy first), the step."""
        def go():
            admit()
            et.slots.apply(defer=fold)
            prepare()
            et.slots.flush()
            finish()
        return go

    step()
    sync()
    rows = int(t.count[0])
    graphs = router.graphs
    bucket = graphs.bucket(tokens) if graphs is not None else None
    pieces = {
        "step": step, "prepare": prepare, "plan": lambda: cap.plan(b),
        "route_tokens": lambda: (router.invalidate(), router.route(
            b, positions=True, rows=cap.rows_to_route(cap.plan(b)))),
        "tok_pos_copy": lambda: router.t.tok_pos[:tokens].copy_(b.positions[:tokens],
                                                                non_blocking=True),
        "route_rows": lambda: cap.route(b, router, cap.plan(b)),
        "collect": lambda: (collect(), steps.pop(0) if len(steps) > 4 else None),
        "collect_to_cpu": lambda: (collect(), to_cpu(), steps.pop(0) if len(steps) > 4 else None),
        "small_launch": lambda: t.count[:1].fill_(0),
        "admit": admit, "admit_apply": lambda: (admit(), et.slots.apply()),
        "admit_step_fold": admit_step(True), "admit_step_copy": admit_step(False),
        "pinned_empty_4k": lambda: torch.empty(1024, dtype=torch.int32,
                                               pin_memory=DEV.type == "cuda"),
    }
    def home(fn):  # the step's rows copied home on the main stream, whatever their size
        def go():
            cap.home_bytes = 1 << 30
            try:
                fn()
            finally:
                del cap.home_bytes
        return go

    pieces["collect_to_cpu_home"] = home(pieces["collect_to_cpu"])
    pieces["step_home"] = home(step)
    if router.staged:
        pieces["stage_layout"] = lambda: router._stage_layout(b, 1)
    if graphs is not None:
        both = graphs._both[id(t)][0][bucket]
        pieces["replay_both"] = both.replay
        pieces["replay_tokens"] = graphs._tokens[0][bucket].replay
        go = driver_launch()
        if go is not None:
            pieces["driver_launch_both"] = go(both)
    out = {"workload": name, "device": gpu_name(), "rows_routed": rows, "cold_us": {},
           "warm_us": {}}
    for key, fn in pieces.items():
        out["cold_us"][key] = cold_us(fn, samples)
        out["warm_us"][key] = warm_us(fn)
        step()  # the tables as a step leaves them
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--label", default="overlay",
                    help="this run's column (the overlay's commit, say)")
    args = ap.parse_args()
    path = Path(os.environ.get("OUT", ".")) / "first-step-host.json"
    kept = merged_with(path, gpu_name(), args.samples)  # before the run: a mismatch stops it
    results = []
    for name, spec in specs().items():
        r = measure(name, spec, args.samples)
        print(json.dumps(r), flush=True)
        results.append(r)
    kept["overlays"][args.label] = results
    path.write_text(json.dumps(kept, indent=1))
    return 0


def merged_with(path: Path, device: str, samples: int) -> dict:
    """The file's runs so far, to add this one's column to: only runs of the same device
    and sample count compare (a column from another machine would read as a change)."""
    fresh = {"device": device, "samples": samples, "overlays": {}}
    if not path.exists():
        return fresh
    kept = json.loads(path.read_text())
    if (kept.get("device"), kept.get("samples")) != (device, samples):
        raise SystemExit(f"{path} holds runs of {kept.get('device')!r} with "
                         f"{kept.get('samples')} samples, not {device!r} with {samples}: "
                         f"move it away or give the same --samples on the same device")
    return kept


if __name__ == "__main__":
    raise SystemExit(main())
