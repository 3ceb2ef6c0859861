"""The benchmarks' workloads, shared by bench_tpot.py, bench_twin.py and profile_capture.py:
real architecture shapes with dummy weights, each bench mode's per-request hooks, the
configured sites they need, and how a finished output's captured rows are counted."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

ARCHS = {  # real architecture shapes; weights are dummy (speed does not depend on them)
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                      bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False,
                      hidden_act="silu", torch_dtype="bfloat16"),
    "qwen2-1.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=1536,
                       intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643,
                       eos_token_id=151643, tie_word_embeddings=True, hidden_act="silu",
                       use_sliding_window=False, torch_dtype="bfloat16"),
}


def model_dir(name: str) -> tuple[str, dict]:
    if name == "tiny":
        from graphtap.testing.tiny_models import SPECS, tiny_model

        return str(tiny_model("llama")), {**SPECS["llama"], "vocab_size": 512}
    d = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    (d / "config.json").write_text(json.dumps(ARCHS[name]))
    return str(d), ARCHS[name]


def hook_config(cfg: dict, modes: list[str], sink: str = "hs") -> dict:
    """The configured sites are the union of the modes' sites (plus the steering site).
    `sink`: the sink mode's layers (sink_layers)."""
    sites = [f"blocks.{steer_layer(cfg)}.hook_resid_post"]
    if {"hs", "mixed", "dump", "sink"} & set(modes):
        sites += [f"blocks.{layer}.hook_resid_post" for layer in hs_layers(cfg)]
    per_token = 3  # dump's rows per token
    if "sink" in modes:
        sites += sink_sites(cfg, sink)
        per_token = max(per_token, len(sink_sites(cfg, sink)))
    if {"qk", "mixed"} & set(modes):
        sites += [f"blocks.{layer}.attn.hook_{k}" for layer in qk_layers(cfg) for k in "qk"]
    if "focus" in modes:  # attention mass is computed at pattern sites
        sites += [f"blocks.{layer}.attn.hook_pattern" for layer in qk_layers(cfg)]
    # dump captures 3 rows per token (a sink of every layer 32): room for a full prefill
    # step of 16k tokens
    config = {"sites": sorted(set(sites)), "max_captures": max(16, per_token),
              "capture_rows": per_token * 16384}
    if "sink" in modes:  # the engine's bulk sink: dump's rows written by its worker
        config["sink_dir"] = tempfile.mkdtemp(prefix="graphtap-sink-")
    return config


def steer_layer(cfg: dict) -> int:
    return cfg["num_hidden_layers"] // 2


def hs_layers(cfg: dict) -> list[int]:  # hallucination-probe style: 3 layers, last token
    n = cfg["num_hidden_layers"]
    return [n // 4, n // 2, 3 * n // 4]


def sink_sites(cfg: dict, which: str) -> list[str]:
    """The sink mode's sites: resid_post at dump's three layers ("hs"), or at every layer
    ("all": a harvest of the whole residual stream, rows per token = layers), or
    resid_mid and resid_post at every layer ("streams": twice the rows per token, the
    most one request may capture being 64 sites; a load whose rows come faster than the
    model makes them at one site per layer, to find the sink's own limit against the
    D2H link)."""
    layers = hs_layers(cfg) if which == "hs" else range(cfg["num_hidden_layers"])
    kinds = ("mid", "post") if which == "streams" else ("post",)
    return [f"blocks.{layer}.hook_resid_{k}" for layer in layers for k in kinds]


def qk_layers(cfg: dict) -> list[int]:  # Attention-Tracker style: 4 layers x 4 heads
    n = cfg["num_hidden_layers"]
    return [n // 8, n // 4, n // 2, 3 * n // 4][:4]


def mode_hooks(mode: str, cfg: dict, vec, prompt_len: int = 256,
               sink: str = "hs") -> dict | None:
    """Per-request spec of a benchmark mode (None: no hooks)."""
    steer = [{"site": f"blocks.{steer_layer(cfg)}.hook_resid_post", "op": "add", "scale": 1.0,
              "vector": vec, "positions": "all"}]
    hs = [{"site": f"blocks.{layer}.hook_resid_post", "positions": "last_prompt"}
          for layer in hs_layers(cfg)]
    heads = list(range(min(4, cfg["num_key_value_heads"])))
    qk = [c for layer in qk_layers(cfg) for c in (
        {"site": f"blocks.{layer}.attn.hook_q", "positions": "last_prompt", "heads": heads},
        {"site": f"blocks.{layer}.attn.hook_k", "positions": "prompt", "heads": heads})]
    dump = [{"site": f"blocks.{layer}.hook_resid_post", "positions": "all"}
            for layer in hs_layers(cfg)]
    # Attention Tracker: the last prompt token's mass on an instruction and a data span,
    # 4 layers x 4 heads, read by a focus guard that annotates (a stop would shorten the
    # run it is measured in)
    n = prompt_len
    focus = {"attention_mass": [{"site": f"blocks.{layer}.attn.hook_pattern", "heads": heads,
                                 "spans": [{"start": 1, "end": n // 4},
                                           {"start": n // 4, "end": n}]}
                                for layer in qk_layers(cfg)],
             "guard": {"kind": "attention_focus", "threshold": 0.5}}
    # a hallucination-probe style guard: one probe on one layer, every generated token
    probe = {"probe": [{"site": f"blocks.{steer_layer(cfg)}.hook_resid_post",
                        "weights": [vec], "positions": "generated"}],
             "guard": {"kind": "probe", "threshold": 1e30}}
    return {"idle": None, "idle2": None, "plain": None, "steer": {"steer": steer},
            "hs": {"capture": hs},
            "qk": {"capture": qk}, "mixed": {"steer": steer, "capture": hs + qk},
            "dump": {"capture": dump}, "focus": focus, "probe": probe,
            "sink": {"capture": [{"site": site, "positions": "all", "sink": True}
                                 for site in sink_sites(cfg, sink)]}}[mode]


def sink_totals(root: str | None) -> tuple[int, int]:
    """(rows, bytes) the engine's sink has written so far (its index.json)."""
    index = Path(root or "/nonexistent") / "index.json"
    if not index.exists():
        return 0, 0
    shards = json.loads(index.read_text())["shards"]
    return sum(s["rows"] for s in shards), sum(s["bytes"] for s in shards)


def link_probe(gib: float = 1.0) -> dict:
    """This machine's physical limits in the same run: device -> pinned host copy
    (cudaMemcpy through torch) and sequential write to the sink's disk, in GB/s."""
    import os
    import time

    import torch

    n = int(gib * 2**30)
    out = {}
    if torch.cuda.is_available():
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        host.copy_(dev)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        out["d2h_gb_s"] = 3 * n / (time.perf_counter() - t) / 1e9
        del dev, host
    path = Path(tempfile.mkdtemp(prefix="graphtap-disk-")) / "probe.bin"
    block = os.urandom(64 << 20)
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    out["disk_write_gb_s"] = n / (time.perf_counter() - t) / 1e9
    path.unlink()
    return out


def count_rows(hooks) -> tuple[int, int, int]:
    """(rows, bytes, 1 if the request's captures failed) of one finished output."""
    if hooks is None:
        return 0, 0, 0
    if getattr(hooks, "error", None):
        return 0, 0, 1
    return (sum(v.shape[0] for v in hooks.values()),
            sum(v.numel() * v.element_size() for v in hooks.values()), 0)


def steer_vector(cfg: dict) -> np.ndarray:
    """The steer mode's vector: fixed seed, norm 4, float32 (offline it travels packed,
    as graphtap.client sends it: a JSON float list would add ~0.3 ms of admission)."""
    vec = np.random.default_rng(7).normal(size=cfg["hidden_size"]).astype(np.float32)
    return vec / np.linalg.norm(vec) * np.float32(4.0)


def mode_order(modes: list[str], rep: int) -> list[str]:
    """The modes in repetition rep's order: row rep of a Williams design (a Latin square
    balanced for the mode before): over len(modes) repetitions (twice that for an odd
    count) every mode runs right after every other mode equally often. A burst runs
    differently after some modes than after others (the A/A control, idle2, always ran
    right after idle when the orders were rotations: +2.0 to +3.4 ms at 64 at once in
    sessions 25 and 27), and a mode that always follows the same one pays that one's
    after-effects in every paired figure."""
    n = len(modes)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    row = rep % (n if n % 2 == 0 else 2 * n)
    order = [modes[(i + row) % n] for i in first]
    return order[::-1] if row >= n else order

