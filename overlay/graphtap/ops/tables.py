"""The tables graph ops read: fixed-address device tensors, allocated once per engine
(engine/tables.py) before the first trace and any graph capture, and refilled before
each step. One `OpTables` holds everything one engine's ops read; the ops find it through
the running engine (ops/running.py), never through module state.

Per-slot entries (R request slots + 1 sentinel slot that never acts) are views into one
int32 block of the engine, one row per slot, so a step's new requests are written with
one copy. Row families (captures, attention patterns) share one routing schema: per step
every wanted (site, token row, head) unit gets a buffer row and a label.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch


class Label(IntEnum):
    """Columns of a row family's labels: written on the device for every buffer row as it
    is routed, so attribution never comes from expected lengths (EasySteer's bug). The
    host reads the first columns (captures SLOT..POSITION, patterns SLOT..HEAD)."""

    SLOT = 0  # request slot
    SITE = 1  # site id; -1 marks a row nothing was routed to this step
    POSITION = 2  # token position in its request
    HEAD = 3  # query head (patterns); 0 for whole-row captures
    TOKEN = 4  # token row in the batch
    BATCH_ROW = 5  # the request's batch row (its row of the block tables)


LABELS = len(Label)
RING_NEVER = 2**31 - 1  # ProbeTables.ring_from of a slot whose probes use no ring
LABEL_DTYPE = torch.int64
ROUTE_MIN_BLOCK = 16  # smallest token block of the routing kernels (route_triton.py)


@dataclass
class SteerTables:
    """Steering entries (E per slot, W bitmap words) and the resident vectors (V rows):
      site[R+1, E]      site id of each entry, -1 = unused (the sentinel's row stays so)
      vec[R+1, E]       row of `bank` holding the entry's vector
      coef[R+1, E, 4]   (a, lo, hi, g): delta = a*v + (clamp(p, lo, hi) - p) * v_hat
                        + g * (v * h), p = <h, v_hat> (g: head scaling at z, v its mask)
      pos[R+1, E, W]    bitmap over positions: the entry applies where bit p is set
      bank[V+1, H]      resident vectors (row 0 is zero), H the widest steered row (the
                        residual or a z row); inv_norm[V+1] = 1/|v| (0: row 0)
    An entry's condition (conditional steering), decided by the op at its site:
      cond_site[R+1, E]     residual site of the condition, -1 = the entry always acts
      cond_vec[R+1, E]      bank row of the condition's vector
      cond_mode[R+1, E]     bits: COND_UNIT (score <h, v_hat>, else <h, v> + bias),
                            COND_SIGMOID, COND_BELOW (on when score < threshold)
      cond_coef[R+1, E, 2]  (bias, threshold)
      cond_pos[R+1, E]      the position whose row decides (the last prompt token)
      gate[R+1, E]          1 once decided on, 0 before or off; written by the op there
    All are views into the engine's slot block (one row stride)."""

    site: torch.Tensor
    vec: torch.Tensor
    coef: torch.Tensor
    pos: torch.Tensor
    bank: torch.Tensor
    inv_norm: torch.Tensor
    max_len: int
    cond_site: torch.Tensor
    cond_vec: torch.Tensor
    cond_mode: torch.Tensor
    cond_coef: torch.Tensor
    cond_pos: torch.Tensor
    gate: torch.Tensor

    @property
    def max_steers(self) -> int:
        return self.site.shape[1]


COND_UNIT, COND_SIGMOID, COND_BELOW = 1, 2, 4  # SteerTables.cond_mode bits


@dataclass
class RowTables:
    """A row family's entries (C per slot), routing and buffer (K rows + 1 trash row):
      entry_site[R+1, C]       site id of each entry, -1 = unused
      entry_pos[R+1, C, W]     position bitmap per entry
      entry_heads[R+1, C, Hq]  1 where the entry wants that query head (patterns), or
                               None: one whole row per wanted token (captures)
      dst[S, N]                buffer row of (site, token row) this step; K = the trash
                               row (captures; None for patterns, whose op reads labels)
      labels[K+1, LABELS]      the Label columns of every buffer row
      count[1 + R+1]           count[0]: rows written this step (<= K); count[1 + slot]: the
                               units each request slot wanted
      head[labels_at + (K+1) * LABELS]  count, then labels from labels_at: one block, so
                               a step's count and used labels go home in one copy
      fits[R+1]                1 where a slot's units all got rows this step: requests are
                               taken whole, in slot order, while they fit (one that does not
                               gets none and fails alone; the rest keep theirs)
      buf[K+1, width]          the rows: captured values in the model's dtype, or
                               attention probabilities over key positions (float32)
      flags[S, N], block_counts[B]  scratch of the GPU routing kernels
    """

    entry_site: torch.Tensor
    entry_pos: torch.Tensor
    entry_heads: torch.Tensor | None
    dst: torch.Tensor | None
    labels: torch.Tensor
    count: torch.Tensor
    head: torch.Tensor
    labels_at: int
    fits: torch.Tensor
    buf: torch.Tensor
    flags: torch.Tensor
    block_counts: torch.Tensor
    num_sites: int

    @property
    def rows(self) -> int:
        return self.buf.shape[0] - 1


@dataclass
class ProbeTables(RowTables):
    """Probe scores, a row family (RowTables: entries, routing, buffer of P float32 scores
    per row), plus per entry what the op computes, act(<h, bank[vec_p]> + bias_p):
      entry_vec[R+1, C, P]   rows of the steering bank (shared, content-keyed) holding
                             the weight vectors; 0 (the zero row) for unused scores
      entry_bias[R+1, C, P]  biases; entry_act[R+1, C]: 1 = sigmoid, 0 = none
    and the ring of generated positions' scores (engine/ring.py):
      ring_from[R+1, 1]      a token at a position >= this, wanted by its entry and routed
                             nowhere, writes the ring; RING_NEVER (the default) never
      ring[R+1, C, G, P]     its scores at [slot, entry, position % G]
      ring_pos[R+1, C, G]    the position each ring row holds (its label), -1 = none
    """

    entry_vec: torch.Tensor = None
    entry_bias: torch.Tensor = None
    entry_act: torch.Tensor = None
    ring_from: torch.Tensor = None
    ring: torch.Tensor = None
    ring_pos: torch.Tensor = None

    @property
    def ring_size(self) -> int:
        return self.ring.shape[2]


@dataclass
class MassTables(RowTables):
    """Attention mass, a row family routed like patterns (one row per wanted query token
    and head), whose rows hold S float32 sums instead of max_model_len probabilities:
      entry_spans[R+1, C, S, 2]  (start, end) key spans per entry; (0, 0) sums nothing
    """

    entry_spans: torch.Tensor = None


@dataclass
class KeyCache:
    """One layer's paged keys, as the pattern op reads them."""

    keys: torch.Tensor  # [blocks, block_size, kv_heads, head_dim] view into the KV cache
    block_table: torch.Tensor  # [max_reqs, max_blocks], rows in batch order, fixed address
    scale: float  # the attention's softmax scale
    group: int  # query heads per KV head (GQA)
    head0: int = 0  # this rank's first query head (tensor parallelism: engine/heads.py);
    # rows of heads it does not hold are left alone (another rank writes them)


@dataclass
class OpTables:
    """Every table one engine's ops read, and the backend picked for them at start.
      tok_slot[N]  request slot of each token row this step; the sentinel R = inactive
      tok_row[N]   batch row of each token row (valid where tok_slot is active)
      tok_pos[N]   position of each token row, for ops whose slot has no positions
                   (attention: steering heads at z); copied by the router each step
    """

    tok_slot: torch.Tensor
    tok_row: torch.Tensor
    tok_pos: torch.Tensor
    steer: SteerTables
    capture: RowTables
    pattern: RowTables | None
    backend: Any  # ops.backend.Backend
    probe: ProbeTables | None = None
    mass: MassTables | None = None
    key_caches: dict[int, KeyCache] = field(default_factory=dict)  # site -> its keys
    # site -> where this rank's slice of the site's rows starts in the TP=1 row (heads
    # held by another rank come before it); absent: 0 (engine/heads.py)
    site_cols: dict[int, int] = field(default_factory=dict)
    # Python bodies run per op: inside replayed CUDA graphs they never run (only their
    # kernels replay), which is how the GPU check proves the ops ran in graphs.
    python_calls: Counter = field(default_factory=Counter)

    @property
    def sentinel(self) -> int:
        return self.steer.site.shape[0] - 1

    def nbytes(self) -> int:
        """Device bytes of every table (views into one block counted once)."""
        seen, total = set(), 0
        for part in (self, self.steer, self.capture, self.pattern, self.probe, self.mass):
            for v in vars(part).values() if part is not None else ():
                if isinstance(v, torch.Tensor):
                    key = v.untyped_storage().data_ptr()
                    if key not in seen:
                        seen.add(key)
                        total += v.untyped_storage().nbytes()
        return total


def position_bit(bitmaps: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """bitmaps [n, W] (one per token row), pos [n] -> whether each row's bit is set.
    Bit j of word w stands for position 32*w + j (spec.positions.position_bitmap)."""
    word = bitmaps.gather(1, (pos >> 5).unsqueeze(1)).squeeze(1)
    return ((word >> (pos & 31)) & 1) == 1


def entry_bits(bitmaps: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """bitmaps [R+1, C, W] (per slot and entry), slot and pos [n] -> [n, C]: whether each
    token's position is set in each entry of its slot (only the one word is gathered)."""
    entries = torch.arange(bitmaps.shape[1], device=pos.device)
    word = bitmaps[slot[:, None], entries[None, :], (pos >> 5)[:, None]]
    return ((word >> (pos & 31)[:, None]) & 1) == 1
