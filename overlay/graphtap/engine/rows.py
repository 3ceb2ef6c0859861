"""What captures and attention patterns share: per-request entries in the slot block, the
host-side step plan (engine/wanted.py), the device routing of their units (one router,
ops/route*.py), and the step's rows handed to the courier.

Every buffer row is labelled on the device as it is routed; the host maps slots to request
ids with the step's own batch, so attribution never comes from expected lengths. Position
rules are evaluated from each token's actual position, so chunked prefill and
recomputation after preemption capture what really ran.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from graphtap.courier import LabelledStep, OverflowKind, StepRows
from graphtap.courier.step_rows import Head
from graphtap.engine.family import FamilyBase
from graphtap.engine.heads import HeadSplit, sum_over_ranks
from graphtap.engine.slots import SlotBlock
from graphtap.engine.tables import EntryFields
from graphtap.engine.wanted import Wants, WantTable, rows_in_step
from graphtap.ops.tables import LABELS, Label, RowTables
from graphtap.spec.entries import NormalisedSpec
from graphtap.spec.positions import runs_bitmap
from graphtap.spec.sites import SiteTable


PLANS = 256  # EntryPlans a family remembers (distinct entries of recent requests)
SHAPES = 64  # prompt lengths a plan remembers its Wants and bitmaps for
SHAPES_BYTES = 4 << 20  # and at most this many bytes of bitmaps (a long max_model_len)


def host_copies(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host tensors of ts' values, in one block (pinned and queued without waiting where
    they are on a GPU: the pinned block is not reused before the copies ran). One
    block, not one each: a pinned allocation is a call on the busy loop that costs
    50-80 us after a quiet spell (an H100 host, first_step_host's pinned_empty_4k)."""
    sizes = [t.numel() * t.element_size() for t in ts]
    at = [0]
    for n in sizes:  # each part 16-byte aligned
        at.append(at[-1] + -(-n // 16) * 16)
    block = torch.empty(at[-1], dtype=torch.uint8, pin_memory=ts[0].is_cuda)
    return tuple(block[a:a + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
                 for t, a, n in zip(ts, at, sizes))


class EntryPlan(NamedTuple):
    """What a request's entries of one family make whatever the request: per entry its
    site id, per site its output format (shared by the requests, never changed), per
    position rule (rule, rows a wanted token yields, the entries using it)."""

    sites: np.ndarray  # int32
    formats: dict
    rules: list[tuple[object, int, list[int]]]
    # per prompt length: the request's Wants (read-only once made: requests share it),
    # every entry's bitmap, [entries, words], and the slot block's columns they set
    # (RowFamily._set_columns), made once for the requests of that length
    shaped: dict[int, tuple[Wants, np.ndarray, tuple]]
    # what a subclass derives from the entries, made once (capture: the columns a row
    # spans, whether any entry reads heads)
    memo: dict


class RowFamily(FamilyBase):
    """A family whose ops write labelled rows; subclasses say which entries are theirs
    and what each becomes (`entries`, `describe`, `kind_of`, `step_class`, ...)."""

    step_class: type[LabelledStep]
    overflow_kind: OverflowKind
    host_labels: int  # label columns the courier reads

    def __init__(self, tables: RowTables, fields: EntryFields, slots: SlotBlock,
                 backend, sites: SiteTable, max_len: int, model_dtype: torch.dtype,
                 split: HeadSplit | None = None):
        self.t, self.fields, self.slots = tables, fields, slots
        self.backend, self.sites = backend, sites
        self.max_len, self.model_dtype = max_len, model_dtype
        # tensor parallelism: this rank holds some heads (engine/heads.py); None: all
        self.split = split if split is not None and split.split else None
        self.site_names = sites.names()
        self._formats: dict[int, dict[int, tuple]] = {}  # slot -> site -> output format
        self._cols: dict[int, int] = {}  # slot -> buffer columns its formats read
        self._slot_of: dict[str, int] = {}
        self._wanted: dict[str, Wants] = {}  # req_id -> positions its entries want
        self._table = WantTable(max_len)  # every live request's, vectorised over a batch
        # (slot -> req_id, row bound, its input batch, rows summed over ranks) of the step
        self._step: tuple | None = None
        self._idle = True
        # the host mirror's site and position fields (views of a block that never moves)
        self._site, self._pos = slots.host_view(fields.site), slots.host_view(fields.pos)
        self._reset_group = None  # reset_slot's fields (extra_fields: subclasses' own)
        # slot -> the columns its entries set, where they were staged alone (stage_runs),
        # which its removal resets
        self._runs: dict[int, np.ndarray] = {}
        self._by_runs: bool | None = None  # _sets_runs, once known (subclasses' fields)
        self._plans: dict[tuple, EntryPlan] = {}  # entries -> their plan (_entry_plan)
        self._writes_extra = type(self).write_extra is not RowFamily.write_extra
        # the stream a large step's rows go home on (LabelledStep._rows_to_cpu): made
        # now, not in a burst's first large step
        self._stream = torch.cuda.Stream(tables.buf.device) if tables.buf.is_cuda else None
        if backend.name != "torch":  # compile the routing kernels now, at start
            sentinel = torch.full((1,), tables.entry_site.shape[0] - 1,
                                  device=tables.buf.device)
            backend.route_rows(tables, sentinel, torch.zeros_like(sentinel),
                               torch.zeros_like(sentinel), max_len)

    # ---------------------------------------------------------------- subclass parts
    def entries(self, spec: NormalisedSpec) -> tuple:
        raise NotImplementedError

    def kind_of(self, entry) -> str:
        raise NotImplementedError

    def describe(self, entry, dtype: torch.dtype) -> tuple[tuple, int]:
        """(output format, rows per wanted token) of an entry."""
        raise NotImplementedError

    # Per-slot fields beyond site, positions and heads (probe weights, mass spans): reset
    # with them whenever a slot is (re)filled or freed.
    extra_fields: tuple = ()

    def write_extra(self, slot: int, i: int, entry) -> None:
        """Fields beyond site and positions (patterns: the chosen heads)."""

    # A step's rows up to this many bytes go home on the main stream (snapshot): a
    # burst's first qk step (one request, 1028 rows of 512 bf16 columns, just over 1
    # MiB) too, whose host calls every later request of the burst waits behind; its
    # copy is some tens of microseconds of the link beside a step of milliseconds
    home_bytes = 2 << 20

    # Whether a request's entries may key the family's remembered EntryPlans (hashing
    # them is cheap: not a probe's, which hold their weights).
    remember_plans = True

    def columns(self, slots, batch) -> int | None:
        """Buffer columns the step's rows can use (slots: the batch's requests with
        entries; batch: the step's input batch); None: all."""
        return None

    def split_rows(self, slots) -> bool:
        """Whether the step's rows hold heads of other ranks (tensor parallelism): its
        rows are zeroed before the forward and summed over the ranks after. Patterns
        and attention mass: rows per head, always."""
        return True

    # ---------------------------------------------------------------- requests
    def add_request(self, slot: int, req_id: str, prompt_len: int,
                    spec: NormalisedSpec) -> EntryPlan | None:
        """Fills the slot from the spec's entries of this family; their EntryPlan, or
        None (no entries: the slot stays inactive)."""
        if self.holds(req_id):  # re-added (a subclass that removes it first: not again)
            self.remove_request(req_id)
        entries = self.entries(spec)
        self._runs.pop(slot, None)
        # entries that set only sites and bitmap words go as those columns, not the row
        if self._by_runs is None:
            self._by_runs = self._sets_runs()
        by_runs = bool(entries) and self._by_runs and \
            self.slots.claim_clean(slot, self._group())
        if not by_runs:
            self.reset_slot(slot, claim=bool(entries))
        self._table.drop(slot)
        if not entries:  # the slot stays inactive: nothing to write (a plain request)
            return None
        # A burst's admission step runs this for each of its requests before the forward
        # (every one's first token waits for it): what the entries make whatever the
        # request is made once per distinct entries, and each position rule's runs and
        # bitmap once for the entries sharing it (benchmarks/cpu: test_first_capture_step)
        plan = self._entry_plan(entries)
        site, pos = self._site, self._pos
        site[slot, :len(plan.sites)] = plan.sites
        wanted, bitmaps, (runs, cols, words) = plan.shaped.get(prompt_len) or \
            self._shape(plan, prompt_len)
        if by_runs:  # the other words of a clean slot are zero already
            self.slots.host[slot, cols] = words
            self._runs[slot] = runs
            self.slots.stage_runs(slot, runs)
        else:
            pos[slot, :len(bitmaps)] = bitmaps
        if self._writes_extra:
            for i, entry in enumerate(entries):
                self.write_extra(slot, i, entry)
        self._formats[slot] = plan.formats
        self._slot_of[req_id] = slot
        self._wanted[req_id] = wanted
        self._table.set(slot, wanted)
        return plan

    def _entry_plan(self, entries: tuple) -> EntryPlan:
        """The entries' EntryPlan, remembered per entries (frozen, hashable: a guard's or
        a harvest's entries are the same in every request) where the family says they
        hash cheaply (probe entries hold their weights)."""
        if not self.remember_plans:
            return self._make_plan(entries)
        plan = self._plans.get(entries)
        if plan is None:
            plan = self._plans[entries] = self._make_plan(entries)
            if len(self._plans) > PLANS:
                del self._plans[next(iter(self._plans))]  # the oldest
        return plan

    def _shape(self, plan: EntryPlan, prompt_len: int):
        """The plan's Wants and bitmaps for a prompt length (EntryPlan.shaped)."""
        wanted = Wants(self.max_len)
        # one block of the entries' rows: a slot's write is then one assignment of a
        # slice (per rule, a list index cost 1.6 us a rule, each request: qk has two)
        bitmaps = np.empty((len(plan.sites), self._pos.shape[2]), self._pos.dtype)
        for rule, per_token, at in plan.rules:
            bitmaps[at] = runs_bitmap(wanted.add(rule, prompt_len, per_token), bitmaps.shape[1])
        while plan.shaped and (len(plan.shaped) >= SHAPES or
                               (len(plan.shaped) + 1) * bitmaps.nbytes > SHAPES_BYTES):
            del plan.shaped[next(iter(plan.shaped))]  # the oldest length
        plan.shaped[prompt_len] = shaped = (wanted, bitmaps, self._set_columns(bitmaps))
        return shaped

    def _set_columns(self, bitmaps: np.ndarray) -> tuple:
        """The block columns entries with these bitmaps set: their sites, and per entry
        the words from its first set bit's to its last's, as runs [m, 2]; and those words'
        columns and values (what a clean slot's row gets beyond the sites)."""
        site, pos, words = self.fields.site.offset, self.fields.pos.offset, bitmaps.shape[1]
        runs = [(site, site + len(bitmaps))]
        for i, row in enumerate(bitmaps):
            set_words = np.flatnonzero(row)
            if len(set_words):
                at = pos + i * words
                runs.append((at + set_words[0], at + set_words[-1] + 1))
        cols = np.concatenate([np.arange(lo, hi) for lo, hi in runs[1:]] or
                              [np.zeros(0, np.int64)])
        return np.array(runs, np.int64), cols, bitmaps.reshape(-1)[cols - pos]

    def _sets_runs(self) -> bool:
        """Whether a request's entries set only their sites and bitmaps (not heads, nor a
        subclass's fields) of a large row: then a clean slot is claimed and released by
        those columns."""
        return self.fields.heads is None and not self.extra_fields and \
            not self._writes_extra and self.slots.stages_runs()

    def _make_plan(self, entries: tuple) -> EntryPlan:
        sites, formats, rules = [], {}, {}
        for i, entry in enumerate(entries):
            sid = self.sites.id_of(entry.layer, self.kind_of(entry))
            sites.append(sid)
            formats[sid], per_token = self.describe(
                entry, self.model_dtype if entry.dtype == "model" else torch.float32)
            rule = rules.setdefault(repr(entry.positions), [entry.positions, 0, []])
            rule[1] += per_token
            rule[2].append(i)
        return EntryPlan(np.array(sites, np.int32), formats, [tuple(r) for r in rules.values()],
                         {}, {})

    def remove_request(self, req_id: str) -> None:
        if req_id in self._slot_of:
            slot = self._slot_of.pop(req_id)
            self._formats.pop(slot, None)
            self._cols.pop(slot, None)
            del self._wanted[req_id]
            self._table.drop(slot)
            runs = self._runs.pop(slot, None)
            if runs is not None:  # the columns its entries set, inactive again
                self.slots.release_runs(slot, self._group(), runs)
            else:  # inactive again (with the next staged writes)
                self.reset_slot(slot, claim=False)

    def _group(self):
        if self._reset_group is None:
            f = self.fields
            self._reset_group = self.slots.group(
                [x for x in (f.site, f.pos, f.heads, *self.extra_fields) if x is not None])
        return self._reset_group

    def reset_slot(self, slot: int, claim: bool | None = None) -> None:
        self._runs.pop(slot, None)  # written whole from now on
        self.slots.reset(slot, self._group(), claim)

    def stats(self) -> dict:
        return {"requests": len(self._slot_of),
                "active_slots": int((self.slots.host_view(self.fields.site) >= 0)
                                    .any(axis=1).sum())}

    def holds(self, req_id: str) -> bool:
        return req_id in self._slot_of

    # ---------------------------------------------------------------- steps
    def plan(self, input_batch) -> int:
        """A bound on the rows the batch's requests may want now (0: none)."""
        if not self._wanted:
            return 0
        bound = self._table.bound(input_batch)
        if bound is None:  # no host view of positions: the loop's answer
            bound = sum(rows for _, _, rows in rows_in_step(self._wanted, input_batch))
        return bound

    def rows_to_route(self, plan) -> RowTables | None:
        """The tables route() routes with `plan` (the router may replay their routing
        with the tokens'), or None."""
        return self.t

    def route(self, input_batch, router, plan) -> None:
        router.route_rows(self.t, input_batch, self.max_len)
        self._idle = False
        bound = min(plan, self.t.rows)
        # Rows are attributed (and overflow reported) for every request of the batch
        # with entries, not only those the host expects to want rows now: the device
        # routes them all, so a wrong host window can cost a step's bound (reported as
        # a graphtap bug) but never drop a live request's rows silently.
        in_batch = {self._slot_of[r]: r for r in input_batch.req_ids if r in self._slot_of}
        split = self.split is not None and self.split_rows(in_batch)
        if split:  # each rank writes its heads' values only (engine/heads.py)
            self.t.buf[:bound].zero_()
        self._step = (in_batch, bound, input_batch, split)

    def deactivate(self) -> None:
        if not self._idle:
            if self.t.dst is not None:
                self.t.dst.fill_(self.t.rows)
            self.t.labels[:, Label.SITE].fill_(-1)
            self._idle = True
        self._step = None

    def snapshot(self) -> LabelledStep | None:
        """The step's used rows, and of them the columns its requests can use (the copy
        home and its pinned buffer shrink with them): a small step's copied home now,
        a larger one's cloned, its rows to go home on the family's stream, its labels
        and count on vLLM's output copy stream."""
        if self._step is None:
            return None
        slot_to_req, bound, batch, split = self._step
        rows = self.t.buf[:bound, :self.columns(slot_to_req, batch)]
        # the family's own per-slot dicts (replaced, never changed, when a slot is
        # refilled): one entry per request, not per request and site
        formats = {s: self._formats[s] for s in slot_to_req}
        home = not split and rows.numel() * rows.element_size() <= self.home_bytes and \
            self.copies_home(slot_to_req)
        # the count and the used rows' labels: one block (RowTables.head), one copy
        t = self.t
        head = Head(t.head[:t.labels_at + bound * LABELS], t.count.shape[0], t.labels_at,
                    self.host_labels)
        if home:
            # Host copies queued on the main stream, ordered before the next step's
            # writes: no device clones, no second copy on the output stream (a hooked
            # step's clones and copies were ~12 API calls on the busy loop, its main
            # cost after the forward); the link's time for a few hundred KiB is a
            # sliver of the next step's.
            block, rows = host_copies(head.block, rows)
            head = head._replace(block=block)
        else:
            # Clones on the main stream: the next step reuses the buffer (async
            # scheduling); they go home after the step's tokens (snapshot.py).
            rows = rows.clone(memory_format=torch.contiguous_format)
            if split:  # the heads of every rank, each value written by one of them
                rows = sum_over_ranks(rows)
            head = head._replace(block=head.block.clone())
        count, labels = head.parts()
        return self.step_class(StepRows(
            rows, labels, count, slot_to_req, formats, self.site_names, self.t.rows,
            self.overflow_kind, home, None if home else self._stream,
            None if home else head))


    def host_copy_bytes(self) -> int:
        """The most bytes a step's rows take home (every buffer row, every column)."""
        buf = self.t.buf
        return buf.shape[0] * buf.shape[1] * buf.element_size()

    def copies_home(self, slots) -> bool:
        """Whether the step's rows may go home at once (not where a device consumer
        reads them after the step: the capture family's sink)."""
        return True
