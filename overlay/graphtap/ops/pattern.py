"""`graphtap::capture_pattern_`: attention probabilities of chosen (query position, head)
rows over every key position, computed from post-RoPE q and the paged K cache.

Reading keys from the cache (through the runner's fixed-address block tables) rather
than from this step's k is what makes patterns complete under chunked prefill and for
decode steps: every key the attention saw is in the cache at the z slot. The routing
labels one buffer row per wanted (token, head) before the step; rows of other sites or
none return at once, so the launch shape never depends on data (graph safe).
"""
from __future__ import annotations

import torch

from graphtap.ops.register import graph_op
from graphtap.ops.running import running_tables
from graphtap.ops.tables import KeyCache, Label, RowTables


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


def pattern_reference(t: RowTables, q: torch.Tensor, kc: KeyCache, site: int) -> None:
    """Torch implementation (free to sync: it runs where there is no device to stall).
    Rows are computed in groups of one position, each over exactly its own keys, so a
    row's values never depend on which other rows share its step (as in the kernel)."""
    for rows, p, probs in probabilities(t, q, kc, site):
        t.buf[rows, : p + 1] = probs


def probabilities(t: RowTables, q: torch.Tensor, kc: KeyCache, site: int):
    """(buffer rows, position p, their probabilities over keys 0..p) per group of this
    site's routed rows at one position (the torch side of patterns and attention mass);
    only rows of the heads q holds (kc.head0 on: tensor parallelism), at q's index."""
    labels = t.labels[: t.rows]
    local = labels[:, Label.HEAD] - kc.head0
    active = ((labels[:, Label.SITE] == site) & (local >= 0) & (local < q.shape[1])) \
        .nonzero().squeeze(1)
    if active.numel() == 0:
        return
    r = t.labels[active]
    tok, head, brow, pos = (r[:, Label.TOKEN], local[active], r[:, Label.BATCH_ROW],
                            r[:, Label.POSITION])
    bs = kc.keys.shape[1]
    for p in torch.unique(pos).tolist():
        rows = (pos == p).nonzero().squeeze(1)
        j = torch.arange(p + 1, device=q.device)
        blocks = kc.block_table[brow[rows]][:, j // bs].long()  # [rows, keys]
        keys = kc.keys[blocks, (j % bs)[None, :], (head[rows] // kc.group)[:, None]].float()
        scores = (keys * q[tok[rows], head[rows]].float()[:, None, :]).sum(-1) * kc.scale
        yield active[rows], p, torch.softmax(scores, dim=-1)


@graph_op("capture_pattern_", mutates=("sink",))
def capture_pattern_(sink: torch.Tensor, q: torch.Tensor, site: int) -> None:
    """`sink` is the attention output (consumed by o_proj next), declared mutated and
    left alone so that dead-code elimination keeps the op; q is [tokens, heads, dim]."""
    t = running_tables("capture_pattern_")
    kc = t.key_caches.get(site)
    if t.pattern is None or kc is None:  # the profiling run, before the cache exists
        return
    t.backend.pattern(t.pattern, q, kc, site)
