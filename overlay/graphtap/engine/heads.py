"""Attention heads under tensor parallelism: which slice of each TP=1 row this rank holds,
and how a step's rows become whole again (issue 19).

Each rank of a tensor-parallel group holds H / tp query heads and KV / tp KV heads (one
KV head, replicated tp / KV times, when KV < tp), as vLLM's QKVParallelLinear shards
them; the residual stream is whole on every rank. graphtap keeps every buffer row in
the TP=1 layout: before a step that captures heads, the rows it may fill are zeroed on
every rank; each rank writes its own heads' columns (and rows, for patterns and
attention mass) and nothing else (only the first rank writes residual rows, a KV head
held by several ranks is written by the first of them); after the forward one
all-reduce (sum) of the step's rows gives every row whole, each value having exactly one
rank that wrote it (x + 0.0 is x: the rows are the same bits as at TP=1's layout).
Requests, labels and routing are the same on every rank, so buffer rows line up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from graphtap.spec.sites import KV_HEAD_KINDS, PATTERN, RESID_KINDS, SiteTable
from graphtap.support import model_heads


@dataclass(frozen=True)
class HeadSplit:
    """One rank's share of the heads (TP=1: rank 0 of 1, every head). The split itself
    is vLLM's (support.py refuses attention sites where the heads do not split)."""

    rank: int
    size: int
    num_heads: int  # query heads of the model (all ranks)
    num_kv_heads: int
    head_dim: int

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def head0(self) -> int:
        """This rank's first query head."""
        return self.rank * self.local_heads

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head (1 unless KV < tp)."""
        return max(1, self.size // self.num_kv_heads)

    @property
    def kv_head0(self) -> int:
        """This rank's first KV head."""
        if self.kv_replicas > 1:
            return self.rank // self.kv_replicas
        return self.rank * (self.num_kv_heads // self.size)

    def writes(self, kind: str) -> bool:
        """Whether this rank writes rows of a site kind: residual rows are whole on every
        rank (the first writes them), a replicated KV head is written by its first rank."""
        if kind in RESID_KINDS:
            return self.rank == 0
        if kind in KV_HEAD_KINDS:
            return self.rank % self.kv_replicas == 0
        return True

    def column(self, kind: str) -> int:
        """Where this rank's slice of a site's row starts in the TP=1 row."""
        if kind in RESID_KINDS:
            return 0
        first = self.kv_head0 if kind in KV_HEAD_KINDS else self.head0
        return first * self.head_dim

    def site_columns(self, sites: SiteTable) -> dict[int, int]:
        """Per row site id (captures, head steering) whose slice starts past column 0,
        where it starts (patterns are rows per head: KeyCache.head0 places them)."""
        return {i: c for i, s in enumerate(sites.sites)
                if s.kind != PATTERN and (c := self.column(s.kind))}

    @property
    def split(self) -> bool:
        return self.size > 1


def head_split(vllm_config) -> HeadSplit:
    """This worker's share of the heads (after vLLM's distributed state exists)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    rank = 0
    if pc.tensor_parallel_size > 1:
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
    return HeadSplit(rank, pc.tensor_parallel_size, *model_heads(mc), mc.get_head_size())


def sum_over_ranks(rows: torch.Tensor) -> torch.Tensor:
    """The step's rows summed over the tensor-parallel group (every rank calls it for
    the same steps: their requests and plans are the same)."""
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(rows)
