"""`graphtap::capture_pattern_`: attention probabilities of chosen (query position, head)
rows over every key position, computed from post-RoPE q and the paged K cache.

Reading keys from the cache (through the runner's fixed-address block tables) rather
than from this step's k is what makes patterns complete under chunked prefill and for
decode steps: every key the attention saw is in the cache at the z slot. The scheduler
writes one route row per wanted (token, head) before the step; rows routed to other
sites or idle return at once, so the launch shape never depends on data (graph safe).
Torch on CPU (the spec of truth, free to sync: there is no device to stall), a Triton
kernel on GPU (pattern_triton.py), tested against each other in Triton's interpreter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from graphtap.tables import PatternTables


@dataclass
class KeyCache:
    """One layer's paged keys, as the pattern op reads them."""

    keys: torch.Tensor  # [blocks, block_size, kv_heads, head_dim] view into the KV cache
    block_table: torch.Tensor  # [max_reqs, max_blocks], rows in batch order, fixed address
    scale: float  # the attention's softmax scale
    group: int  # query heads per KV head (GQA)


_tables: PatternTables | None = None
_caches: dict[int, KeyCache] = {}


def bind_pattern_tables(tables: PatternTables | None) -> None:
    global _tables
    _tables = tables


def bind_key_caches(caches: dict[int, KeyCache]) -> None:
    """site id -> its layer's keys; rebound whenever the runner (re)allocates the cache."""
    _caches.clear()
    _caches.update(caches)


def key_cache_view(kv_cache: torch.Tensor, backend: str, head_size: int) -> torch.Tensor:
    """The K half of one layer's paged cache as [blocks, block_size, kv_heads, head_dim],
    without copying. Backends split K and V differently inside a block."""
    if backend == "CPU_ATTN:vec":
        # [blocks, kv_heads, block_size, 2*D]: per head, K first, stored transposed
        # ([D, block_size], so the kernel's dot products run along tokens), then V.
        nb, nh, bs, _ = kv_cache.shape
        k = kv_cache.view(nb, nh, 2 * bs * head_size)[:, :, : bs * head_size]
        return k.view(nb, nh, head_size, bs).permute(0, 3, 1, 2)
    if backend in ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER") and kv_cache.dim() == 4 \
            and kv_cache.shape[-1] == 2 * head_size:
        # Logical [blocks, kv_heads, block_size, 2*D] with K in the first D channels.
        return kv_cache.transpose(1, 2)[..., :head_size]
    raise ValueError(f"hook_config.sites: attn.hook_pattern does not support the {backend} "
                     f"attention backend (KV cache shape {tuple(kv_cache.shape)}); "
                     f"supported: CPU_ATTN (vec ISA), FLASH_ATTN, TRITON_ATTN, FLASHINFER")


def pattern_reference(t: PatternTables, q: torch.Tensor, kc: KeyCache, site: int) -> None:
    active = (t.route[: t.rows, 0] == site).nonzero().squeeze(1)
    if active.numel() == 0:
        return
    r = t.route[active]
    tok, head, brow, pos = r[:, 1], r[:, 2], r[:, 3], r[:, 4]
    span = int(pos.max()) + 1
    j = torch.arange(span, device=q.device)
    bs = kc.keys.shape[1]
    blocks = kc.block_table[brow][:, j // bs].long()  # [rows, keys]
    keys = kc.keys[blocks, (j % bs)[None, :], (head // kc.group)[:, None]].float()
    scores = torch.einsum("rjd,rd->rj", keys, q[tok, head].float()) * kc.scale
    scores = scores.masked_fill(j[None, :] > pos[:, None], float("-inf"))
    t.buf[active, :span] = torch.softmax(scores, dim=-1)


@torch.library.custom_op("graphtap::capture_pattern_", mutates_args=("sink",))
def capture_pattern_(sink: torch.Tensor, q: torch.Tensor, site: int) -> None:
    """`sink` is the attention output (consumed by o_proj next), declared mutated and
    left alone so that dead-code elimination keeps the op; q is [tokens, heads, dim]."""
    kc = _caches.get(site)
    if _tables is None or kc is None:  # profiling run before the cache exists
        return
    if q.is_cuda:
        from graphtap.ops.pattern_triton import pattern_triton

        pattern_triton(_tables, q, kc, site)
    else:
        pattern_reference(_tables, q, kc, site)


@capture_pattern_.register_fake
def _(sink, q, site) -> None:
    return None
