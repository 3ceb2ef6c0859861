"""Steering vectors built from the engine itself: the difference of means of a site's
residual stream over positive and negative prompts (contrastive activation addition),
from graphtap's own captures, so the vector is what the served model computes.

    v = contrast(llm, ["I love this", ...], ["I hate this", ...], "blocks.6.hook_resid_post")
    v.save("joy.safetensors")      # a vectors_dir file: registers as "joy"
    hooks = {"steer": [{"site": v.site, "op": "add", "vector": v.values.tolist(), "scale": 4}]}
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

from graphtap.spec.sites import parse_site


@dataclass
class ContrastVector:
    """mean(positive) - mean(negative) at `site`, and where each side projects on it."""

    values: np.ndarray  # float32 [hidden]
    site: str
    positions: str
    positive_projection: float  # mean <h, v_hat> over the positive prompts
    negative_projection: float
    metadata: dict = field(default_factory=dict)

    @property
    def unit(self) -> np.ndarray:
        norm = float(np.linalg.norm(self.values))
        return self.values / norm if norm > 0 else self.values

    def save(self, path, name: str | None = None) -> None:
        """One tensor (the stem names it in a vectors_dir) with the metadata (strings)."""
        from pathlib import Path

        from safetensors.numpy import save_file

        path = Path(path)
        meta = {**self.metadata, "site": self.site, "positions": self.positions,
                "positive_projection": repr(self.positive_projection),
                "negative_projection": repr(self.negative_projection)}
        save_file({name or path.stem: self.values.astype(np.float32)}, str(path),
                  metadata={k: str(v) for k, v in meta.items()})

    @classmethod
    def load(cls, path) -> "ContrastVector":
        from safetensors import safe_open

        with safe_open(str(path), "np") as f:
            meta = dict(f.metadata() or {})
            (key,) = list(f.keys())
            values = f.get_tensor(key)
        return cls(values, meta.pop("site"), meta.pop("positions"),
                   float(meta.pop("positive_projection")),
                   float(meta.pop("negative_projection")), meta)


def save_probe(path, weight, bias=None, activation: str = "none",
               metadata: dict | None = None) -> None:
    """A linear probe as a safetensors file: "weight" [P, hidden] and "bias" [P] float32,
    the activation and any metadata as strings. In a vectors_dir it registers as the
    probe named by its stem (`"weights": "<stem>"` in a probe entry)."""
    from safetensors.numpy import save_file

    weight = np.atleast_2d(np.asarray(weight, dtype=np.float32))
    bias = np.zeros(len(weight), np.float32) if bias is None else \
        np.asarray(bias, dtype=np.float32).reshape(-1)
    save_file({"weight": weight, "bias": bias}, str(path),
              metadata={**{k: str(v) for k, v in (metadata or {}).items()},
                        "activation": activation})


def load_probe(path) -> dict:
    """A probe file as the fields of a probe entry (weights, bias, activation):
    `{"probe": [{"site": ..., **load_probe("truth.safetensors")}]}`."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        weight = f.get_tensor("weight")
        bias = f.get_tensor("bias") if "bias" in f.keys() else np.zeros(len(weight), np.float32)
        activation = (f.metadata() or {}).get("activation", "none")
    if weight.ndim != 2 or bias.shape != (weight.shape[0],):
        raise ValueError(f"{path}: a probe file holds weight [P, hidden] and bias [P]")
    return {"weights": weight.astype(np.float32).tolist(),
            "bias": bias.astype(np.float32).tolist(), "activation": activation}


def prompt_hash(positive, negative) -> str:
    return hashlib.sha256(json.dumps([positive, negative]).encode()).hexdigest()[:16]


def chat_ids(tokenizer, text: str) -> list[int]:
    """A user turn through the model's chat template, ready for the assistant's answer
    (the template's text, tokenised without adding special tokens twice)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=False)
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def _inputs(llm, prompts, chat: bool):
    """vLLM prompt dicts: token ids as given, text, or chat turns through the template."""
    out = []
    for p in prompts:
        if isinstance(p, (list, tuple)) and p and isinstance(p[0], int):
            out.append({"prompt_token_ids": list(p)})
        elif chat:
            out.append({"prompt_token_ids": chat_ids(llm.get_tokenizer(), p)})
        else:
            out.append({"prompt": p})
    return out


def site_means(llm, prompts, site: str, positions="last_prompt", chat: bool = False):
    """Per prompt, the mean of the captured rows at `site` (float32 [prompts, hidden])."""
    from vllm import SamplingParams

    hooks = {"capture": [{"site": site, "positions": positions, "dtype": "float32"}]}
    params = SamplingParams(max_tokens=1, temperature=0.0, hooks=hooks)
    outs = llm.generate(_inputs(llm, prompts, chat), params, use_tqdm=False)
    rows = []
    for prompt, out in zip(prompts, outs):
        if out.hooks is None or out.hooks.error:
            raise RuntimeError(f"capture of {site} failed for {prompt!r}: "
                               f"{out.hooks.error if out.hooks else 'no hooks'}")
        rows.append(np.asarray(out.hooks[site], dtype=np.float32).mean(axis=0))
    return np.stack(rows)


def contrast(llm, positive, negative, site: str, positions="last_prompt",
             chat: bool = False) -> ContrastVector:
    """The difference of means of `site` over positive and negative prompts (strings,
    token id lists, or user turns with `chat=True`), each prompt first averaged over its
    captured positions; the site must be configured in the engine's hook_config."""
    if not positive or not negative:
        raise ValueError("contrast: needs at least one positive and one negative prompt")
    layers = llm.llm_engine.model_config.hf_text_config.num_hidden_layers
    name = parse_site(site, layers).name
    pos = site_means(llm, positive, name, positions, chat)
    neg = site_means(llm, negative, name, positions, chat)
    values = (pos.mean(0) - neg.mean(0)).astype(np.float32)
    norm = float(np.linalg.norm(values))
    unit = values / norm if norm > 0 else values
    meta = {"model": llm.llm_engine.model_config.model, "prompts_sha256": prompt_hash(
        [p if isinstance(p, str) else list(p) for p in positive],
        [p if isinstance(p, str) else list(p) for p in negative]),
        "n_positive": len(positive), "n_negative": len(negative), "chat": chat}
    return ContrastVector(values, name, json.dumps(positions), float((pos @ unit).mean()),
                          float((neg @ unit).mean()), meta)
