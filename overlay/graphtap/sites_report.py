"""`graphtap sites MODEL`: every hook site of a model, with the shape of one row (per
position) it captures, from the model's config alone (no weights, no engine)."""
from __future__ import annotations

from graphtap.spec.sites import ATTN_KINDS, RESID_KINDS, Site
from graphtap.support import WITH_SLOTS

PATTERNS = ("attn.hook_pattern needs a plain causal attention with an unquantised KV cache "
            "(no sliding window, no soft cap), on the CPU_ATTN (vec ISA), FLASH_ATTN, "
            "TRITON_ATTN or FLASHINFER backend; anything else is refused at engine start")


def report(model: str) -> dict:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    cfg = getattr(cfg, "text_config", None) or cfg
    arch = (getattr(cfg, "architectures", None) or ["?"])[0]
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    shape = {"attn_q": [heads, head_dim], "attn_z": [heads, head_dim],
             "attn_k": [kv_heads, head_dim], "attn_v": [kv_heads, head_dim],
             "attn_pattern": [heads, "keys"]}
    note = {"attn_k": "KV heads (GQA)", "attn_v": "KV heads (GQA)",
            "attn_pattern": "query heads x key positions 0..p", "attn_q": "post-RoPE",
            "attn_z": "per head, before o_proj"}
    rows = []
    for layer in range(layers):
        for kind in RESID_KINDS + ATTN_KINDS:
            residual = kind in RESID_KINDS
            rows.append({"site": Site(layer, kind).name,
                         "shape": [hidden] if residual else shape[kind],
                         "note": "steerable; hidden_states + residual" if residual
                         else note[kind]})
    slots = arch in WITH_SLOTS
    return {"model": model, "architecture": arch, "layers": layers, "slots": slots,
            "sites": rows if slots else [],
            "patterns": PATTERNS if slots else
            f"{arch} has no hook slots (supported: {', '.join(WITH_SLOTS)})"}
