"""The soak's requests (benchmarks/soak.py): a catalogue of cases, each a prompt with a
spec and sampling settings, and the comparison of a response with its solo run."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from graphtap.wire import decode

TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Prompt injection asks a model to ignore its previous instructions."]
LONG = ("Interpretability engineers read the residual stream of a transformer. "
        "Steering vectors shift the hidden state of a language model at run time. ")


@dataclass
class Case:
    """One kind of request: sent alone first (its reference), then many times under load."""

    name: str
    prompt: list[int]
    hooks: dict | None
    max_tokens: int
    sampling: dict = field(default_factory=dict)

    def body(self) -> dict:
        body = {"model": "m", "prompt": self.prompt, "max_tokens": self.max_tokens,
                "ignore_eos": True, "return_token_ids": True, "temperature": 0.0,
                **self.sampling}
        if self.hooks is not None:
            body["hooks"] = self.hooks
        return body

    @property
    def greedy(self) -> bool:
        return not self.sampling.get("temperature")


def _vector(hidden: int, seed: int) -> list[float]:
    v = np.random.default_rng(seed).standard_normal(hidden)
    return (v / np.linalg.norm(v) * 4).astype(np.float32).tolist()


def specs(hidden: int, heads: int, kv_heads: int) -> list[tuple[str, dict | None, dict]]:
    """(name, hooks, sampling): every steering op and rule, every capture kind and rule,
    patterns, both, n = 2, sampling."""
    def steer(op, site, seed, **kw):
        return {"site": site, "op": op, "vector": _vector(hidden, seed), **kw}

    sampled = {"temperature": 0.8, "top_p": 0.95, "seed": 7}
    return [
        ("plain", None, {}),
        ("plain-sampled", None, sampled),
        ("steer-add", {"steer": [steer("add", "blocks.2.hook_resid_post", 1, scale=3.0)]}, {}),
        ("steer-set-projection", {"steer": [steer("set_projection", "blocks.1.hook_resid_pre",
                                                  2, target=-2.0, positions="generated")]}, {}),
        ("steer-ablate", {"steer": [steer("ablate", "blocks.0.hook_resid_post", 3,
                                          positions="prompt")]}, {}),
        ("steer-clamp", {"steer": [steer("clamp", "blocks.3.hook_resid_pre", 4, min=-0.5,
                                         max=0.5, positions="last_prompt")]}, {}),
        ("capture-residual", {"capture": [
            {"site": "blocks.0.hook_resid_pre", "dtype": "float32"},
            {"site": "blocks.1.hook_resid_mid", "positions": "prompt"},
            {"site": "blocks.3.hook_resid_post", "positions": "generated"}]}, {}),
        ("capture-attention", {"capture": [
            {"site": "blocks.1.attn.hook_q", "heads": [0, heads - 1]},
            {"site": "blocks.1.attn.hook_k", "heads": [kv_heads - 1], "positions": "prompt"},
            {"site": "blocks.1.attn.hook_v", "positions": "last_prompt"},
            {"site": "blocks.1.attn.hook_z", "positions": "generated", "dtype": "float32"}]},
         {}),
        ("pattern", {"capture": [
            {"site": "blocks.1.attn.hook_pattern", "heads": [1], "positions": "last_prompt"}]},
         {}),
        ("pattern-generated", {"capture": [
            {"site": "blocks.1.attn.hook_pattern", "heads": [0, heads - 1],
             "positions": "generated"}]}, {}),
        ("steer-and-capture", {"steer": [steer("add", "blocks.2.hook_resid_post", 5,
                                               scale=2.0)],
                               "capture": [{"site": "blocks.2.hook_resid_post"},
                                           {"site": "blocks.1.attn.hook_pattern",
                                            "heads": [2 % heads], "positions": "generated"}],
                               "encoding": "safetensors"}, {}),
        ("steer-n2", {"steer": [steer("add", "blocks.1.hook_resid_post", 6, scale=2.0)]},
         {"n": 2, "temperature": 0.8, "seed": 11}),
        ("capture-sampled", {"capture": [{"site": "blocks.1.hook_resid_post"}]},
         {"temperature": 0.7, "seed": 3}),
    ]


def catalogue(model: Path, args) -> list[Case]:
    from transformers import AutoTokenizer

    cfg = json.loads((Path(model) / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    tok = AutoTokenizer.from_pretrained(str(model))
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    long = tok(LONG * 8, add_special_tokens=False)["input_ids"]
    prompts = ids + [long[:150], long[:230]]  # longer than the chunked-prefill budget
    # The longest prompt generates long too: running requests then outgrow the KV pool
    # in decode, and the scheduler preempts (and later recomputes) some of them.
    return [Case(f"{name}/p{i}", p, hooks,
                 args.long_tokens if i == len(prompts) - 1 else args.max_tokens,
                 sampling)
            for name, hooks, sampling in specs(hidden, heads, kv_heads)
            for i, p in enumerate(prompts)]


def compare(case: Case, solo: dict, got: dict, tol: float) -> dict[str, int]:
    """Counts for one response against its solo run."""
    out = {"tokens_differ": 0, "sampled_tokens_differ": 0, "rows_lost": 0,
           "rows_misattributed": 0, "rows_checked": 0, "withheld_with_error": 0}
    same_tokens = True
    for a, b in zip(solo["choices"], got["choices"]):
        if a["token_ids"] != b["token_ids"]:
            same_tokens = False
            out["tokens_differ" if case.greedy or tol == 0 else "sampled_tokens_differ"] += 1
    if len(solo["choices"]) != len(got["choices"]):
        out["tokens_differ"] += 1
    want = decode(solo["choices"][0].get("hooks"), as_torch=False)
    have = decode(got["choices"][0].get("hooks"), as_torch=False)
    if want is None:
        out["rows_lost"] += int(have is not None and bool(len(have)))
        return out
    if want.error:
        return out
    if have is None:
        out["rows_lost"] += sum(len(p) for p in want.positions.values())
        return out
    if have.error:
        out["withheld_with_error"] += 1
        return out
    prompt_len = len(case.prompt)
    for site, rows in want.items():
        pos = np.asarray(want.positions[site])
        keep = np.ones(len(pos), bool) if same_tokens else pos < prompt_len
        out["rows_checked"] += int(keep.sum())
        if site not in have:
            out["rows_lost"] += int(keep.sum())
            continue
        got_pos = np.asarray(have.positions[site])
        if not same_tokens:
            got_keep = got_pos < prompt_len
            got_pos, got_rows = got_pos[got_keep], np.asarray(have[site])[got_keep]
        else:
            got_rows = np.asarray(have[site])
        if not np.array_equal(got_pos, pos[keep]):
            out["rows_lost"] += int(keep.sum())
            continue
        a, b = np.asarray(rows)[keep].astype(np.float32), got_rows.astype(np.float32)
        if a.shape != b.shape:
            out["rows_misattributed"] += int(keep.sum())
            continue
        flat_a, flat_b = a.reshape(len(a), -1), b.reshape(len(b), -1)
        if tol == 0:
            bad = ~np.all((flat_a == flat_b) | (np.isnan(flat_a) & np.isnan(flat_b)), axis=1)
        else:
            bad = ~np.all(np.abs(flat_a - flat_b) <= tol * (1 + np.abs(flat_a)), axis=1)
        out["rows_misattributed"] += int(bad.sum())
    return out
