"""Host-side step planning of the row families: which requests of a batch may want rows
in this step, and a bound on how many, without a device sync. A request that wants only
prompt positions (a last-prompt probe) costs nothing while it decodes, and the bound sizes
the step's copy home (a last-prompt probe's prefill copies one row per entry, not one per
prompt token)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from graphtap.spec.positions import position_runs, runs_count


# WantTable's plain-Python path: batches of at most PLAIN_BATCH requests whose rules
# have at most PLAIN_RUNS runs each
PLAIN_BATCH, PLAIN_RUNS = 16, 8


class Wants:
    """A request's wanted positions, one set of runs per distinct position rule, each
    with the rows a wanted token yields (entries using the rule; heads, for patterns)."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self._by_rule: dict[str, list] = {}  # repr(rule) -> [runs, rows per token]
        self.end = 0  # past the last wanted position: decoding past a probe costs nothing
        self.table_rules = None  # WantTable.set's forms of the runs, made once (shared)

    def add(self, rule, prompt_len: int, rows_per_token: int) -> tuple[np.ndarray, np.ndarray]:
        """Adds an entry's rule; returns the rule's runs (spec.positions.position_runs:
        the family's bitmap is made from them, once per rule)."""
        key = repr(rule)
        if key not in self._by_rule:
            runs = position_runs(rule, prompt_len, self.max_len)
            self._by_rule[key] = [runs, 0]
            self.end = max(self.end, int(runs[1][-1]) if runs[1].size else 0)
        self._by_rule[key][1] += rows_per_token
        return self._by_rule[key][0]

    def rows_in(self, lo: int, hi: int, tokens: int) -> int:
        """Upper bound on rows from `tokens` tokens at positions within [lo, hi)."""
        if lo >= self.end:
            return 0
        return sum(per * min(tokens, runs_count(runs, lo, hi))
                   for runs, per in self._by_rule.values())


class WantTable:
    """Every live request's wanted positions as runs, for one numpy pass per step: the
    bound rows_in_step computes, without a Python iteration per request (its loop was
    ~10 us a request per step on the H200 host: 2 % of a decode step at 16 requests
    whose probe scores every generated token)."""

    def __init__(self, max_len: int):
        self._max_len = max_len
        # slot -> (runs of each rule: start, end, rows per token; Wants.end)
        self._by_slot: dict[int, tuple[list[tuple[np.ndarray, np.ndarray, int]], int]] = {}
        self._flat: tuple[np.ndarray, ...] | None = None
        # slot -> (rules as (run starts, run ends, rows per token) in plain ints, Wants.end)
        # for requests of few runs; a slot in _by_slot but not here (scattered positions)
        # sends its batches through the numpy pass
        self._plain: dict[int, tuple[list[tuple[list, list, int]], int]] = {}
        # per slot its Wants.end (0: none), kept up to date, never rebuilt: a large batch's
        # rows past their last wanted position are told apart in a few numpy calls
        self._ends = np.zeros(0, np.int64)

    def set(self, slot: int, wants: Wants) -> None:
        """The slot's wanted positions (`wants`: complete, never changed after this; the
        requests of one entry plan and prompt length share it, rows.EntryPlan.shaped)."""
        if wants.table_rules is None:
            rules = [(*runs, per) for runs, per in wants._by_rule.values()]
            plain = ([(s.tolist(), e.tolist(), per) for s, e, per in rules], wants.end) \
                if sum(len(starts) for starts, _, _ in rules) <= PLAIN_RUNS else None
            wants.table_rules = ((rules, wants.end), plain)
        self._by_slot[slot], plain = wants.table_rules
        self._flat = None
        if slot >= len(self._ends):
            self._ends = np.concatenate([self._ends, np.zeros(slot + 1 - len(self._ends),
                                                              np.int64)])
        self._ends[slot] = wants.end
        if plain is None:
            self._plain.pop(slot, None)
        else:
            self._plain[slot] = plain

    def drop(self, slot: int) -> None:
        self._plain.pop(slot, None)
        if self._by_slot.pop(slot, None) is not None:
            self._flat = None
            self._ends[slot] = 0

    def bound(self, input_batch) -> int | None:
        """rows_in_step's total for the batch, or None without a host view of positions
        (the caller's loop handles that)."""
        small = self._small_rows(input_batch)
        if small is not None:
            return sum(small)
        rows = self._array_rows(input_batch)
        return None if rows is None else int(rows.sum())

    def rows(self, input_batch) -> np.ndarray | None:
        """rows_in_step's bound per batch row (int64 [num_reqs]), or None without a host
        view of positions."""
        small = self._small_rows(input_batch)
        return np.array(small, np.int64) if small is not None else \
            self._array_rows(input_batch)

    def _array_rows(self, input_batch) -> np.ndarray | None:
        """rows() in one numpy pass over the batch."""
        w = batch_windows(input_batch)
        if w is None:
            return None
        if not self._by_slot:
            return np.zeros(len(w.slots), np.int64)
        start, end, rule, rule_slot, per, last = self._table()
        if not len(rule_slot):
            return np.zeros(len(w.slots), np.int64)
        slots, lo, tokens = w.slots, w.lo, w.tokens
        # every request past its last wanted position (decoding past a last-prompt
        # capture): none wants a row, in 3 operations instead of the pass's 15
        known = slots < len(last)
        if not (lo[known] < last[slots[known]]).any():
            return np.zeros(len(slots), np.int64)
        hi = np.minimum(w.hi, self._max_len)
        size = max(int(slots.max(initial=0)), int(rule_slot.max())) + 1
        lo_s, hi_s, tok_s = (np.zeros(size, np.int64) for _ in range(3))
        lo_s[slots], hi_s[slots], tok_s[slots] = np.maximum(lo, 0), hi, tokens
        at = rule_slot[rule]
        overlap = np.minimum(end, hi_s[at]) - np.maximum(start, lo_s[at])
        counts = np.bincount(rule, np.maximum(overlap, 0), minlength=len(rule_slot))
        by_rule = np.minimum(counts, tok_s[rule_slot]) * per
        return np.bincount(rule_slot, by_rule, minlength=size)[slots].astype(np.int64)

    def _small_rows(self, input_batch) -> list[int] | None:
        """rows() in plain Python where few requests of the batch may want rows now and
        their rules have few runs (a burst's steps: the new requests' prompts beside
        requests decoding past their last wanted position), None otherwise: the numpy
        pass and the table's rebuild after an admission cost ~15 numpy calls, more than
        this loop over a few requests' runs (benchmarks/cpu: test_want_bound)."""
        n = len(input_batch.req_ids)
        computed = getattr(input_batch, "num_computed_tokens_np", None)
        slots = getattr(input_batch, "idx_mapping_np", None)
        if computed is None or slots is None:
            return None
        drafts = getattr(input_batch, "num_draft_tokens_per_req", None)
        if n > PLAIN_BATCH:
            # the rows that may want any: lo < the slot's end, as the loop below says
            pick = self._active(slots[:n], computed[:n], drafts, n)
            if len(pick) > PLAIN_BATCH:
                return None
            rows = pick.tolist()
        else:
            pick, rows = slice(0, n), range(n)
        slots = np.asarray(slots)[pick].tolist()
        if any(s not in self._plain and s in self._by_slot for s in slots):
            return None  # a request of many runs
        drafts = np.asarray(drafts)[pick].tolist() if drafts is not None else [0] * len(slots)
        scheduled = np.asarray(input_batch.num_scheduled_tokens)[pick].tolist()
        out, max_len = [0] * n, self._max_len
        for i, slot, done, tokens, slack in zip(rows, slots, np.asarray(computed)[pick].tolist(),
                                                scheduled, drafts):
            wants = self._plain.get(slot)
            lo = max(done - slack, 0)
            if wants is None or lo >= wants[1]:
                continue
            hi, count_rows = min(done + tokens, max_len), 0
            for starts, ends, per in wants[0]:
                count = sum(max(min(e, hi) - max(s, lo), 0) for s, e in zip(starts, ends))
                count_rows += per * min(count, tokens)
            out[i] = count_rows
        return out

    def _active(self, slots, computed, drafts, n: int) -> np.ndarray:
        """Batch rows whose request may want a position from this step on (the window's
        start before its Wants.end); slots the table never held want none."""
        slots = np.asarray(slots, np.int64)
        lo = computed.astype(np.int64) - drafts[:n] if drafts is not None else computed
        ends = self._ends
        if len(slots) and int(slots.max()) >= len(ends):
            ends = np.concatenate([ends, np.zeros(int(slots.max()) + 1 - len(ends), np.int64)])
        return np.flatnonzero(lo < ends[slots])

    def _table(self) -> tuple[np.ndarray, ...]:
        """(run starts, run ends, each run's rule, each rule's slot, each rule's rows per
        token, per slot its Wants.end), over every live request: rebuilt in the first
        step after an admission with one concatenation per array, not a numpy call per
        rule of every live request (that loop was ~70 us at 64 live on the dev CPU,
        ~3x that on the H200 host, in every step that admits)."""
        if self._flat is None:
            rules = [(slot, *rule) for slot, (runs, _) in self._by_slot.items()
                     for rule in runs]
            last = np.zeros(max(self._by_slot, default=-1) + 1, np.int64)
            last[list(self._by_slot)] = [end for _, end in self._by_slot.values()]
            self._flat = (
                _cat([r[1] for r in rules]), _cat([r[2] for r in rules]),
                np.repeat(np.arange(len(rules), dtype=np.int64), [len(r[1]) for r in rules]),
                np.array([r[0] for r in rules], np.int64),
                np.array([r[3] for r in rules], np.int64), last)
        return self._flat


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays).astype(np.int64, copy=False) if arrays else \
        np.zeros(0, np.int64)


def rows_in_step(wants: dict[str, Wants], input_batch) -> list[tuple[int, str, int]]:
    """(batch row, request id, bound on its rows) of the requests whose wanted positions
    may fall in this step's tokens: WantTable's answer, one request at a time, which the
    families use where the batch has no host view of positions (and tests hold the table
    to). Host-side, so it may err towards routing: with speculative decoding the host's
    computed-token count can run ahead by the rejected drafts, and the window widens by
    them. Requests that want nothing now (a last_prompt capture while decoding) then
    cost nothing on the device, and the bound sizes the step's copy to the host (a
    last_prompt probe's prefill copies one row per entry, not one per prompt token)."""
    computed = getattr(input_batch, "num_computed_tokens_np", None)
    drafts = getattr(input_batch, "num_draft_tokens_per_req", None)
    out = []
    for i, r in enumerate(input_batch.req_ids):
        want = wants.get(r)
        if want is None:
            continue
        tokens = int(input_batch.num_scheduled_tokens[i])
        if computed is None:  # no host view of positions: every token may capture
            out.append((i, r, want.rows_in(0, want.max_len, tokens)))
            continue
        slack = int(drafts[i]) if drafts is not None else 0
        lo = max(int(computed[i]) - slack, 0)
        hi = min(int(computed[i]) + tokens, want.max_len)
        rows = want.rows_in(lo, hi, tokens)
        if rows:
            out.append((i, r, rows))
    return out


class Windows(NamedTuple):
    """Per batch row, int64: its slot, the first position the step may run (widened by
    the drafts: rows_in_step says why), past the last one, and its tokens."""

    slots: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    tokens: np.ndarray


def batch_windows(input_batch) -> Windows | None:
    """The batch's Windows, or None without a host view of positions."""
    computed = getattr(input_batch, "num_computed_tokens_np", None)
    slots = getattr(input_batch, "idx_mapping_np", None)
    if computed is None or slots is None:
        return None
    n = len(input_batch.req_ids)
    computed = computed[:n].astype(np.int64)
    tokens = np.asarray(input_batch.num_scheduled_tokens[:n], np.int64)
    drafts = getattr(input_batch, "num_draft_tokens_per_req", None)
    lo = computed - drafts[:n] if drafts is not None else computed
    return Windows(np.asarray(slots[:n], np.int64), lo, computed + tokens, tokens)


def positions_end(input_batch, max_len: int) -> int:
    """A host-side bound on every position in the batch, plus one (no sync)."""
    computed = getattr(input_batch, "num_computed_tokens_np", None)
    if computed is None or not input_batch.num_reqs:
        return max_len
    n = input_batch.num_reqs
    ends = computed[:n].astype(np.int64) + input_batch.num_scheduled_tokens[:n]
    return min(int(ends.max()), max_len)
