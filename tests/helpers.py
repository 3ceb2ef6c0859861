"""Helpers shared by the test modules (none imports another test module)."""
from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from contextlib import contextmanager

import numpy as np
import torch

MAX_TOKENS = 12


def vector(hidden: int, seed: int = 0) -> list[float]:
    return np.random.default_rng(seed).normal(size=hidden).astype(np.float32).tolist()


def run(llm, ids, hooks=None, max_tokens=MAX_TOKENS, **kw):
    """One greedy request: (tokens, their logprobs)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, hooks=hooks, **kw)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    return tokens, [lp[t].logprob for lp, t in zip(out.logprobs, tokens)]


def assert_parity(got, want):
    (gt, glp), (wt, wlp) = got, want
    assert gt == wt, f"tokens differ:\n vllm {gt}\n hf   {wt}"
    assert np.max(np.abs(np.array(glp) - np.array(wlp))) < 1e-4, (glp, wlp)


def assert_captures_equal_hf(llm, path, ids, sites: list[str], steer: dict) -> None:
    """Capture `sites` (float32) of one greedy request steered by `steer`: its tokens
    equal HF's with the same steering, and every site's rows come back once per position
    HF ran, within 1e-4 of HF's residual stream."""
    from vllm import SamplingParams

    from graphtap.testing.engines import _hf_model
    from graphtap.testing.hf_reference import hf_capture

    hooks = {"capture": [{"site": s, "dtype": "float32"} for s in sites], **steer}
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, hooks=hooks),
                       use_tqdm=False)[0]
    want, wpos, tokens = hf_capture(_hf_model(str(path)), ids, MAX_TOKENS, sites, steer)
    assert list(out.outputs[0].token_ids) == tokens
    for s in sites:
        assert out.hooks.positions[s].tolist() == wpos[s].tolist(), s
        assert (out.hooks[s] - want[s]).abs().max().item() <= 1e-4, s


def assert_head_captures_equal_hf(out, want: dict, positions, caps: list[dict]) -> None:
    """Each q/k/v/z capture of `caps` (in that order) came back at HF's positions, its
    chosen heads in ascending order, within 1e-4 of HF's (hf_capture_attention)."""
    for k, cap in zip("qkvz", caps):
        site = cap["site"]
        ref = want[k][:, sorted(cap["heads"])] if cap.get("heads") else want[k]
        assert out.hooks.positions[site].tolist() == positions.tolist(), site
        assert out.hooks[site].shape == ref.shape, (site, out.hooks[site].shape, ref.shape)
        assert (out.hooks[site] - ref).abs().max().item() <= 1e-4, site


def sizes(**overrides):
    """Table sizes for engine-less unit tests (graphtap.engine.tables.Sizes)."""
    from graphtap.engine.tables import Sizes

    base = dict(max_reqs=4, max_tokens=24, max_len=100, num_sites=3, hidden=64,
                dtype=torch.float32, max_steers=3, max_vectors=5, max_captures=2,
                capture_rows=10, capture_width=64, pattern_rows=40, num_heads=4, patterns=True)
    merged = {**base, **overrides}
    merged.setdefault("steer_width", merged["hidden"])  # no z row wider than the residual
    return Sizes(**merged)


def capture_step(rows, labels, used, slot_to_req, formats, names):
    """A capture step as the capture family hands it to the courier (after the copy):
    `labels` (slot, site, position) of the rows, `used` of them written, and per slot
    the units it wanted (its labelled rows)."""
    from graphtap.courier import CaptureStep, StepRows
    from graphtap.courier.chunks import OverflowKind

    wanted = torch.bincount(torch.tensor([s for s, _, _ in labels[:used]] or [0],
                                         dtype=torch.long), minlength=max(slot_to_req) + 2)
    if not used:
        wanted.zero_()
    return CaptureStep(StepRows(rows.clone(), torch.tensor(labels), torch.cat(
        [torch.tensor([used]), wanted]), slot_to_req, formats, names, 1000,
        OverflowKind.CAPTURE_ROWS))


def engine_tables(**overrides):
    """An engine's tables on the CPU, torch backend (graphtap.engine.tables.EngineTables)."""
    from graphtap.engine.tables import allocate
    from graphtap.ops.backend import TORCH

    return allocate(sizes(**overrides), TORCH, torch.device("cpu"))


# ---------------------------------------------------------------- a vllm serve process

def engine_request(rid: str, max_tokens: int = 2):
    """An EngineCoreRequest of 3 prompt tokens, as the frontend admits it (for an
    OutputProcessor without an engine)."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(
        request_id=rid, prompt_token_ids=[1, 2, 3], mm_features=None,
        sampling_params=SamplingParams(max_tokens=max_tokens, detokenize=False),
        pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None,
        data_parallel_rank=None, external_req_id=rid)


def post(url: str, body: dict, timeout: float = 120):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextmanager
def vllm_server(model, args: list[str], log_path, start_timeout: float = 300,
                graphtap_cli: bool = False):
    """`vllm serve MODEL ARGS` (or `graphtap serve MODEL ARGS`) on a free loopback port;
    yields its base URL."""
    import pytest

    from graphtap.testing.servers import ServerFailed, free_port, running_server

    port = free_port()
    entry = ["graphtap.cli"] if graphtap_cli else ["vllm.entrypoints.cli.main"]
    cmd = [sys.executable, "-m", *entry, "serve", str(model),
           "--host", "127.0.0.1", "--port", str(port), *args]
    try:
        with running_server(cmd, port, {**os.environ, "TRITON_INTERPRET": "1"}, log_path,
                            start_timeout) as base:
            yield base
    except ServerFailed as e:
        pytest.fail(str(e))


class RecordingSink:
    """A sink writer (courier/sink.py's producer side) that keeps what it is handed:
    `handovers` counts put_runs calls, `puts` lists each run as (site, request,
    position, values, token) with its slice of the labels."""

    def __init__(self):
        self.puts, self.handovers, self.flushes = [], 0, 0

    def put_runs(self, request, position, token, runs, ready=None):
        from graphtap.courier.sink_labels import owned_int64

        self.handovers += 1
        self.ready = ready
        request, position, token = map(owned_int64, (request, position, token))  # as _take
        at = 0
        for site, count, chunks in runs:
            self.puts.append((site, np.asarray(request[at:at + count]),
                              np.asarray(position[at:at + count]), chunks,
                              np.asarray(token[at:at + count])))
            at += count

    def flush(self):
        self.flushes += 1
