"""Attention patterns: per request, the chosen query heads' probabilities over every key
position, computed on the device from q and the paged K cache (ops/pattern*.py), one
buffer row per (query token, head)."""
from __future__ import annotations

import torch

from graphtap.courier import OverflowKind, PatternFormat, PatternStep
from graphtap.courier.patterns import HOST_LABELS
from graphtap.engine.rows import RowFamily
from graphtap.engine.wanted import positions_end
from graphtap.ops.pattern import key_cache_view
from graphtap.ops.tables import KeyCache
from graphtap.spec.entries import NormalisedSpec
from graphtap.spec.sites import PATTERN


class PatternFamily(RowFamily):
    """Attention patterns; one buffer row per wanted (token, chosen head)."""

    name = "pattern"
    step_class = PatternStep
    overflow_kind = OverflowKind.PATTERN_ROWS
    host_labels = HOST_LABELS

    def __init__(self, *args, key_caches: dict[int, KeyCache], **kwargs):
        super().__init__(*args, **kwargs)
        self.key_caches = key_caches  # the engine's OpTables.key_caches, filled here

    def entries(self, spec: NormalisedSpec) -> tuple:
        return spec.pattern

    def kind_of(self, entry) -> str:
        return PATTERN

    def write_extra(self, slot: int, i: int, entry) -> None:
        self.slots.host_view(self.fields.heads)[slot, i, list(entry.heads)] = 1

    def describe(self, entry, dtype: torch.dtype) -> tuple[PatternFormat, int]:
        return PatternFormat(dtype, len(entry.heads)), len(entry.heads)  # a row per head

    def columns(self, slots, batch) -> int:
        # a pattern row spans max_model_len keys; no step reaches past its last position
        return positions_end(batch, self.max_len)

    def bind_kv_caches(self, layers: list) -> None:
        """Each pattern site's layer: its paged keys and its group's block table."""
        from vllm.model_executor.layers.hook_slots import hook_layer_index

        caches = {}
        for layer in layers:
            site = self.sites.id_for_slot(hook_layer_index(layer.name), PATTERN)
            if site is None:
                continue
            if layer.kv_cache_dtype != "auto" or layer.logits_soft_cap or \
                    layer.sliding_window is not None:
                raise ValueError(f"hook_config.sites: {self.site_names[site]} needs a plain "
                                 f"causal attention with an unquantised KV cache")
            keys = key_cache_view(layer.kv_cache, layer.backend, layer.head_size)
            # layer.num_heads: this rank's (tensor parallelism), from head0 on
            caches[site] = KeyCache(keys, layer.block_table, layer.scale,
                                    layer.num_heads // layer.num_kv_heads,
                                    self.split.head0 if self.split is not None else 0)
        self.key_caches.clear()
        self.key_caches.update(caches)
