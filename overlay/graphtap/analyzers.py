"""Analyzers: plain functions over what a request returned (torch tensors), each the host
side cross-check of a device path: probe scores from captured rows (vs the probe op),
attention from captured post-RoPE q and k (vs the pattern op), the Attention Tracker
focus score and per-head summaries from patterns, and the logit lens on a residual site.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch


def probe_scores(rows: torch.Tensor, weights, bias=None, activation: str = "none"):
    """act(rows @ W.T + b) in float32: [positions, probes], as `probe:<site>` returns."""
    w = torch.as_tensor(weights, dtype=torch.float32).reshape(-1, rows.shape[-1])
    score = rows.float() @ w.T
    if bias is not None:
        score = score + torch.as_tensor(bias, dtype=torch.float32)
    return torch.sigmoid(score) if activation == "sigmoid" else score


def attention_from_qk(q: torch.Tensor, k: torch.Tensor, q_positions, k_positions,
                      scale: float | None = None) -> torch.Tensor:
    """Causal softmax(q k^T * scale) from captured rows: q [Tq, Hq, d] at q_positions,
    k [Tk, Hkv, d] at k_positions (every position 0..max once, as a capture of "all"
    returns them); GQA maps query head h to KV head h // (Hq / Hkv). Returns
    [Tq, Hq, max key position + 1], zero past each query's own position."""
    q_pos = torch.as_tensor(q_positions)
    k_pos = torch.as_tensor(k_positions)
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    keys = torch.zeros((int(k_pos.max()) + 1, *k.shape[1:]), dtype=torch.float32)
    keys[k_pos] = k.float()
    group = q.shape[1] // k.shape[1]
    keys = keys.repeat_interleave(group, dim=1)  # [Tk, Hq, d]
    scores = torch.einsum("qhd,khd->qhk", q.float(), keys) * scale
    future = torch.arange(keys.shape[0])[None, :] > q_pos[:, None]  # [Tq, Tk]
    scores = scores.masked_fill(future[:, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)


def span_mass(pattern: torch.Tensor, spans) -> torch.Tensor:
    """Attention mass on each key span: pattern [..., keys], spans [(start, end), ...]
    (end exclusive) -> [..., len(spans)]."""
    return torch.stack([pattern[..., s:e].sum(-1) for s, e in spans], dim=-1)


def focus_score(pattern: torch.Tensor, instruction: tuple[int, int], data: tuple[int, int],
                heads=None) -> float:
    """The Attention Tracker score (Hung et al. 2025) of one query row: pattern
    [heads, keys] of the last prompt token (or [1, heads, keys]); per head
    sum(attn[instruction]) / (sum(attn[instruction]) + sum(attn[data])), mean over the
    chosen heads. Low focus on the instruction is what an injection looks like."""
    p = pattern.reshape(-1, pattern.shape[-1]).float()
    if heads is not None:
        p = p[list(heads)]
    mass = span_mass(p, [instruction, data])
    return float((mass[:, 0] / (mass[:, 0] + mass[:, 1]).clamp_min(1e-30)).mean())


def head_summary(pattern: torch.Tensor, q_positions) -> list[dict]:
    """Per query head, over the query rows of a pattern capture [Tq, heads, keys]: mean
    entropy (nats), mean max weight, mean mass on the first token (attention sink) and
    on the query itself, mean distance attended back."""
    p = pattern.float()
    q_pos = torch.as_tensor(q_positions).float()
    keys = torch.arange(p.shape[-1]).float()
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [Tq, H]
    self_mass = p.gather(-1, q_pos.long()[:, None, None].expand(-1, p.shape[1], 1))[..., 0]
    distance = ((q_pos[:, None, None] - keys[None, None, :]) * p).sum(-1)
    out = []
    for h in range(p.shape[1]):
        out.append({"head": h, "entropy": float(entropy[:, h].mean()),
                    "max": float(p[:, h].max(-1).values.mean()),
                    "first_token": float(p[:, h, 0].mean()),
                    "self": float(self_mass[:, h].mean()),
                    "distance": float(distance[:, h].mean())})
    return out


class LogitLens:
    """The model's final norm and unembedding, read from its safetensors weights, applied
    to residual rows: what the model would predict if it stopped at that site."""

    def __init__(self, norm_weight: torch.Tensor, unembed: torch.Tensor, eps: float):
        self.norm_weight, self.unembed, self.eps = norm_weight.float(), unembed.float(), eps

    @classmethod
    def from_pretrained(cls, path) -> "LogitLens":
        """A Llama/Qwen2-style checkpoint directory (model.norm, lm_head or tied
        embeddings, rms_norm_eps)."""
        from safetensors import safe_open

        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        tensors = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    if key in ("model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"):
                        tensors[key] = f.get_tensor(key)
        unembed = tensors.get("lm_head.weight", tensors.get("model.embed_tokens.weight"))
        if unembed is None or "model.norm.weight" not in tensors:
            raise ValueError(f"{path}: no model.norm / unembedding weights found")
        return cls(tensors["model.norm.weight"], unembed, config.get("rms_norm_eps", 1e-6))

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        x = rows.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        return x @ self.unembed.T

    def top(self, rows: torch.Tensor, k: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, probabilities) of the k likeliest tokens per row."""
        probs = torch.softmax(self.logits(rows), -1)
        top = probs.topk(k, dim=-1)
        return top.indices, top.values
