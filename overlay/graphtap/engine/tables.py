"""Every table of one engine, allocated once in the hook manager's constructor, which the
runner calls right after building the model: before memory profiling (so the memory is
accounted), the first trace and any graph capture, at addresses that never change."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from graphtap.engine.slots import SlotBlock, SlotField, SlotLayout
from graphtap.ops.backend import Backend
from graphtap.ops.tables import (LABEL_DTYPE, LABELS, RING_NEVER, ROUTE_MIN_BLOCK, Label,
                                 MassTables, OpTables, ProbeTables, RowTables, SteerTables)
from graphtap.spec.positions import bitmap_words


@dataclass(frozen=True)
class Sizes:
    """The engine's table sizes, from vLLM's config and hook_config."""

    max_reqs: int  # request slots (max_num_seqs); one more is the sentinel
    max_tokens: int  # token rows of a step (batched tokens, or the largest graph)
    max_len: int  # max_model_len: positions the bitmaps cover
    num_sites: int
    hidden: int
    steer_width: int  # the widest steered row: the residual, or z (heads x head_dim)
    dtype: torch.dtype  # the model's
    max_steers: int
    max_vectors: int
    max_captures: int
    capture_rows: int
    capture_width: int  # the widest configured capture site
    pattern_rows: int
    num_heads: int  # query heads of the model (pattern head selection)
    patterns: bool  # whether a pattern site is configured
    max_probes: int = 0  # probe entries per request (0: no probe tables, no probe op)
    probe_width: int = 8
    probe_rows: int = 1
    probe_ring: int = 16  # generated positions per slot and entry in the probe ring
    max_spans: int = 8  # attention mass (with patterns): spans per entry
    mass_rows: int = 1
    staging_depth: int = 2  # the slot block's staged-write buffers (slots.Staging)


@dataclass(frozen=True)
class SteerFields:
    """Steering's per-slot fields (ops.tables.SteerTables views them)."""

    site: SlotField
    vec: SlotField
    coef: SlotField
    pos: SlotField
    cond_site: SlotField
    cond_vec: SlotField
    cond_mode: SlotField
    cond_coef: SlotField
    cond_pos: SlotField
    gate: SlotField

    @property
    def all(self) -> list[SlotField]:
        return [self.site, self.vec, self.coef, self.pos, self.cond_site, self.cond_vec,
                self.cond_mode, self.cond_coef, self.cond_pos, self.gate]


@dataclass(frozen=True)
class EntryFields:
    """A row family's per-slot entries."""

    site: SlotField
    pos: SlotField
    heads: SlotField | None


@dataclass(frozen=True)
class ProbeFields:
    """Probes' per-slot fields: a row family's entries and what each one computes."""

    entries: EntryFields
    vec: SlotField
    bias: SlotField
    act: SlotField
    ring_from: SlotField  # [1]: positions from here on go to the ring (never: RING_NEVER)


@dataclass(frozen=True)
class MassFields:
    """Attention mass's per-slot fields: entries with heads, and their key spans."""

    entries: EntryFields
    spans: SlotField


@dataclass
class EngineTables:
    """The engine's tables: what its ops read, and the staged block of per-slot rows."""

    ops: OpTables
    slots: SlotBlock
    steer: SteerFields
    capture: EntryFields
    pattern: EntryFields | None
    probe: ProbeFields | None = None
    mass: MassFields | None = None


def _entries(layout: SlotLayout, count: int, words: int, heads: int | None) -> EntryFields:
    return EntryFields(layout.reserve((count,), torch.int32, -1),
                       layout.reserve((count, words), torch.int32, 0),
                       None if heads is None else layout.reserve((count, heads), torch.int32, 0))


def _rows(s: Sizes, block: SlotBlock, fields: EntryFields, rows: int, width: int,
          dtype: torch.dtype, scatter: bool, device, cls=RowTables, **extra) -> RowTables:
    sites = max(s.num_sites, 1)
    # count and labels in one block (RowTables.head), the labels 16-byte aligned
    counts = s.max_reqs + 2
    at = counts + counts % 2
    head = torch.zeros((at + (rows + 1) * LABELS,), dtype=LABEL_DTYPE, device=device)
    labels = head[at:].view(rows + 1, LABELS)
    labels[:, Label.SITE] = -1
    return cls(
        entry_site=block.view(fields.site), entry_pos=block.view(fields.pos),
        entry_heads=None if fields.heads is None else block.view(fields.heads),
        dst=torch.full((sites, s.max_tokens), rows, dtype=torch.int64, device=device)
        if scatter else None,
        labels=labels, count=head[:counts], head=head, labels_at=at,
        fits=torch.zeros((s.max_reqs + 1,), dtype=torch.int32, device=device),
        buf=torch.zeros((rows + 1, width), dtype=dtype, device=device),
        flags=torch.zeros((sites, s.max_tokens), dtype=torch.int32, device=device),
        block_counts=torch.zeros((sites * -(-s.max_tokens // ROUTE_MIN_BLOCK),),
                                 dtype=torch.int32, device=device),
        num_sites=sites, **extra)


def allocate(s: Sizes, backend: Backend, device: torch.device) -> EngineTables:
    words = bitmap_words(s.max_len)
    layout = SlotLayout()
    steer = SteerFields(layout.reserve((s.max_steers,), torch.int32, -1),
                        layout.reserve((s.max_steers,), torch.int32, 0),
                        # (a, lo, hi, g) of an unused entry: no change
                        layout.reserve((s.max_steers, 4), torch.float32,
                                       (0.0, -float("inf"), float("inf"), 0.0)),
                        layout.reserve((s.max_steers, words), torch.int32, 0),
                        # conditions: site -1 = none; mode bits unit|sigmoid|below;
                        # (bias, threshold); the deciding position; the gate, which the
                        # op writes (the host only clears it when the slot is refilled)
                        *(layout.reserve((s.max_steers,), torch.int32, fill)
                          for fill in (-1, 0, 0)),
                        layout.reserve((s.max_steers, 2), torch.float32, (0.0, 0.0)),
                        *(layout.reserve((s.max_steers,), torch.int32, fill)
                          for fill in (-1, 0)))
    capture = _entries(layout, s.max_captures, words, None)
    pattern = _entries(layout, s.max_captures, words, s.num_heads) if s.patterns else None
    probe = None
    if s.max_probes:
        c, p = s.max_probes, s.probe_width
        probe = ProbeFields(_entries(layout, c, words, None),
                            layout.reserve((c, p), torch.int32, 0),
                            layout.reserve((c, p), torch.float32, 0.0),
                            layout.reserve((c,), torch.int32, 0),
                            layout.reserve((1,), torch.int32, RING_NEVER))
    mass = MassFields(_entries(layout, s.max_captures, words, s.num_heads),
                      layout.reserve((s.max_captures, s.max_spans, 2), torch.int32, 0)) \
        if s.patterns else None
    block = SlotBlock(layout, s.max_reqs + 1, device, s.staging_depth)
    f32 = dict(dtype=torch.float32, device=device)
    ops = OpTables(
        tok_slot=torch.full((s.max_tokens,), s.max_reqs, dtype=torch.int64, device=device),
        tok_row=torch.zeros((s.max_tokens,), dtype=torch.int64, device=device),
        tok_pos=torch.zeros((s.max_tokens,), dtype=torch.int64, device=device),
        steer=SteerTables(site=block.view(steer.site), vec=block.view(steer.vec),
                          coef=block.view(steer.coef), pos=block.view(steer.pos),
                          cond_site=block.view(steer.cond_site),
                          cond_vec=block.view(steer.cond_vec),
                          cond_mode=block.view(steer.cond_mode),
                          cond_coef=block.view(steer.cond_coef),
                          cond_pos=block.view(steer.cond_pos), gate=block.view(steer.gate),
                          bank=torch.zeros((s.max_vectors + 1, s.steer_width), dtype=s.dtype,
                                           device=device),
                          inv_norm=torch.zeros((s.max_vectors + 1,), **f32), max_len=s.max_len),
        capture=_rows(s, block, capture, s.capture_rows, s.capture_width, s.dtype, True, device),
        pattern=_rows(s, block, pattern, s.pattern_rows, s.max_len, torch.float32, False, device)
        if pattern is not None else None,
        backend=backend,
        probe=_rows(s, block, probe.entries, s.probe_rows, s.probe_width, torch.float32, True,
                    device, ProbeTables, entry_vec=block.view(probe.vec),
                    entry_bias=block.view(probe.bias), entry_act=block.view(probe.act),
                    ring_from=block.view(probe.ring_from),
                    ring=torch.zeros((s.max_reqs + 1, s.max_probes, s.probe_ring,
                                      s.probe_width), **f32),
                    ring_pos=torch.full((s.max_reqs + 1, s.max_probes, s.probe_ring), -1,
                                        dtype=torch.int32, device=device))
        if probe is not None else None,
        mass=_rows(s, block, mass.entries, s.mass_rows, s.max_spans, torch.float32, False,
                   device, MassTables, entry_spans=block.view(mass.spans))
        if mass is not None else None)
    return EngineTables(ops, block, steer, capture, pattern, probe, mass)
