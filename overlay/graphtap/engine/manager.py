"""graphtap's hook manager, worker side (graphtap.seam is vLLM's entry point).

The runner builds it right after the model (before profiling, compile and capture), so
every table exists, at its final address, before the first trace. It holds the engine's
tables, the token router and a list of hook families, and loops over them at every call
of the seam; it decides at trace time, from configuration only, which ops the graph gets.
"""
from __future__ import annotations

from pathlib import Path

import torch
from vllm.model_executor.layers.hook_slots import hook_layer_index
from vllm.v1.worker.gpu.hooks import HookManager, hook_config

import graphtap.ops  # noqa: F401  registers the graph ops before any trace
from graphtap.config import HookConfig, load_hook_config
from graphtap.courier import StepSnapshots
from graphtap.courier.held import Ending, StepBatch
from graphtap.courier.held_chunks import HeldChunks, holds_outputs
from graphtap.courier.later import Unsettled
from graphtap.courier.pinned import warm_pinned_pool
from graphtap.courier.sink import SinkFailed, SinkWriter
from graphtap.courier.staging import Staging
from graphtap.engine.families.capture import CaptureFamily
from graphtap.engine.families.mass import MassFamily
from graphtap.engine.families.pattern import PatternFamily
from graphtap.engine.families.probe import ProbeFamily
from graphtap.engine.families.steer import SteerFamily
from graphtap.engine.families.vectors import VectorBank
from graphtap.engine.heads import head_split
from graphtap.engine.router import TokenRouter
from graphtap.engine.rows import RowFamily
from graphtap.engine.tables import Sizes, allocate
from graphtap.log import get_logger
from graphtap.ops.backend import select_backend
from graphtap.profiling import HostClock, named
from graphtap.spec.entries import WireSpecs
from graphtap.spec.sites import PATTERN, RESID_KINDS
from graphtap.support import model_heads, refuse_unsupported

logger = get_logger(__name__)


def _sizes(vllm_config, config: HookConfig, sites, patterns: bool,
           capture_width: int) -> Sizes:
    mc, sc = vllm_config.model_config, vllm_config.scheduler_config
    heads, _ = model_heads(mc)  # the model's, not this rank's (engine/heads.py)
    max_tokens = max(sc.max_num_batched_tokens,
                     vllm_config.compilation_config.max_cudagraph_capture_size or 0)
    return Sizes(max_reqs=sc.max_num_seqs, max_tokens=max_tokens, max_len=mc.max_model_len,
                 num_sites=len(sites), hidden=mc.get_hidden_size(),
                 steer_width=max(mc.get_hidden_size(), heads * mc.get_head_size()),
                 dtype=mc.dtype,
                 max_steers=config.max_steers, max_vectors=config.max_vectors,
                 max_captures=config.max_captures,
                 capture_rows=config.capture_rows_for(sites, max_tokens),
                 capture_width=capture_width, pattern_rows=config.pattern_rows,
                 num_heads=heads, patterns=patterns,
                 max_probes=config.max_probes, probe_width=config.probe_width,
                 probe_rows=config.probe_rows,
                 probe_ring=config.probe_ring, max_spans=config.max_spans,
                 mass_rows=config.mass_rows,
                 # steps the engine may run ahead of the device (async scheduling,
                 # pipeline stages): vLLM's own staged-write buffers count the same
                 staging_depth=max(2, getattr(vllm_config, "max_concurrent_batches", 2)))


def _widths(vllm_config) -> dict[str, tuple[int, int]]:
    """Row width and head_dim (0: no heads) of each capturable kind: every head's, as at
    TP=1, whatever this rank holds (engine/heads.py)."""
    mc = vllm_config.model_config
    d = mc.get_head_size()
    q, kv = (heads * d for heads in model_heads(mc))
    return {**{k: (mc.get_hidden_size(), 0) for k in RESID_KINDS},
            "attn_q": (q, d), "attn_z": (q, d), "attn_k": (kv, d), "attn_v": (kv, d)}


def _sink(vllm_config, config):
    """The engine's bulk sink writer (hook_config.sink_dir), on the worker whose outputs
    vLLM returns (the first of a tensor-parallel group); a data-parallel replica writes a
    folder of its own."""
    if config.sink_dir is None:
        return None
    from vllm.distributed import get_tensor_model_parallel_rank

    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size > 1 and get_tensor_model_parallel_rank() != 0:
        return None
    root = Path(config.sink_dir)
    if pc.data_parallel_size > 1:
        root = root / f"dp-{pc.data_parallel_rank}"
    # on a GPU the step copies land in pinned memory reserved now, as large as the bound
    staging = None
    if vllm_config.device_config.device_type == "cuda":
        try:
            staging = Staging(config.sink_max_queued_bytes, pin=True)
        except (RuntimeError, AttributeError) as e:  # torch's allocator still works
            logger.warning("graphtap sink: no pinned staging memory (%s); step copies "
                           "use torch's pinned allocator", e)
    return SinkWriter(root, config.sink_shard_rows, config.sink_max_queued_bytes,
                      staging=staging)


def _pinned_stats() -> dict:
    """torch's caching host allocator on a GPU worker: pinned blocks it had to create
    and the time that took (a step copy that grows the pool waits for it)."""
    if not torch.cuda.is_initialized():  # a CPU worker (never initialise CUDA here)
        return {}
    try:
        h = torch.cuda.memory.host_memory_stats()
    except (AttributeError, RuntimeError):
        return {}
    # the bytes of the blocks created beside their count: a run's growth of one over the
    # other is their mean size (which sizes the warm-up missed: the first qk burst
    # still grew the pool, s40)
    return {"pinned": {"host_alloc_total": h.get("num_host_alloc", 0),
                       "host_alloc_us_total": h.get("host_alloc_time.total", 0),
                       "host_alloc_bytes_total": h.get("allocated_bytes.allocated", 0),
                       "bytes_peak": h.get("allocated_bytes.peak", 0)}}


class EngineHooks(HookManager):
    """The worker half of vLLM's HookManager: graph-safe steering, captures and patterns
    (graphtap.seam adds the frontend half)."""

    def __init__(self, vllm_config, model, device):
        super().__init__(vllm_config, model, device)
        device = torch.device(device)
        self.config = load_hook_config(hook_config(vllm_config))
        mc = vllm_config.model_config
        self.sites = self.config.site_table(mc.hf_text_config.num_hidden_layers)
        refuse_unsupported(vllm_config, self.config)
        patterns = any(s.kind == PATTERN for s in self.sites.sites)
        backend = select_backend(device)
        widths = _widths(vllm_config)
        sizes = _sizes(vllm_config, self.config, self.sites, patterns,
                       max(w for w, _ in widths.values()))
        tables = allocate(sizes, backend, device)
        self.op_tables = tables.ops  # what the graph ops read (ops/running.py)
        self.split = head_split(vllm_config)  # this rank's heads
        self.op_tables.site_cols.update(self.split.site_columns(self.sites))
        self.slots = tables.slots
        # Heads are steered at z, whose slot has no positions: the router copies them.
        self.router = TokenRouter(tables.ops, positions=any(
            s.kind == "attn_z" for s in self.sites.sites), staging_depth=sizes.staging_depth,
            slots=tables.slots)
        rows = dict(backend=backend, sites=self.sites, max_len=mc.max_model_len,
                    model_dtype=mc.dtype, split=self.split)
        bank = VectorBank(tables.ops.steer)  # resident vectors: steering and probe weights
        self.steer = SteerFamily(tables, self.sites, bank)
        self.sink = _sink(vllm_config, self.config)
        self.families = [
            self.steer,
            CaptureFamily(tables.ops.capture, tables.capture, tables.slots,
                          widths=widths, sink=self.sink, **rows)]
        self.probes = tables.probe is not None
        self.max_len = mc.max_model_len
        if self.probes:
            self.probe_family = ProbeFamily(tables.ops.probe, tables.probe, tables.slots,
                                            bank=bank, **rows)
            self.families.append(self.probe_family)
        if patterns:
            self.families.append(PatternFamily(tables.ops.pattern, tables.pattern, tables.slots,
                                               key_caches=tables.ops.key_caches, **rows))
            self.families.append(MassFamily(tables.ops.mass, tables.mass, tables.slots, **rows))
        # after every family: their row routing joins the token routing's CUDA graphs
        self.router.capture_graphs([f.t for f in self.families if isinstance(f, RowFamily)],
                                   mc.max_model_len)
        self._guards: dict[str, tuple] = {}  # req_id -> (GuardEntry, prompt_len)
        # Requests with stop strings, which the frontend checks: one may finish on a
        # step's tokens before a message of that step's large values that came after
        # them (patch 0008) arrives, so their values all travel inside the message.
        self._stops: set[str] = set()
        self.clock = HostClock()  # this engine's host time per phase (stats: "host")
        self.clock.watch_gc()  # and the process's collections, which stop the busy loop
        self.wire_specs = WireSpecs()  # a burst's requests share a spec: decoded once
        # deferred splits no settle has made (courier/later.py), and whether they travel
        # whole to the frontend (one API server: its requests all go to it)
        self.unsettled = Unsettled(ship=self.config.split_in_frontend and getattr(
            vllm_config.parallel_config, "_api_process_count", 1) == 1)
        self.hold = HeldChunks(self.config.hold_outputs_bytes) \
            if self.config.hold_outputs_bytes > 0 else None
        self._device = device
        warmed = self._warm_pinned()  # an engine without CUDA graphs starts from this
        logger.info("graphtap: %d hook sites, families %s, %s ops, tables %.1f MiB, "
                    "pinned pool warmed %.1f MiB", len(self.sites),
                    [f.name for f in self.families], backend.name,
                    tables.ops.nbytes() / 2**20, warmed / 2**20)

    # ---------------------------------------------------------------- trace time
    def residual_slot(self, layer, kind, positions, hidden_states, residual) -> None:
        # Emits ops only for configured sites (static, not data).
        site = self.sites.id_for_slot(layer, kind)
        if site is None:
            return
        # The stream is residual + hidden_states; in the first layer's input, hidden_states
        # alone. Steer first, then capture what flows on.
        x, other = (hidden_states, None) if residual is None else (residual, hidden_states)
        torch.ops.graphtap.steer_resid_(x, other, positions, site)
        if self.split.writes(kind):  # the stream is whole on every rank: one writes it
            torch.ops.graphtap.capture_resid_(x, other, site)
        if self.probes:
            torch.ops.graphtap.probe_resid_(x, other, positions, site)

    def attention_slot(self, layer_name, kind, sink, *tensors) -> None:
        layer = hook_layer_index(layer_name)
        if kind == "z":
            site = self.sites.id_for_slot(layer, "attn_z")
            if site is not None:  # steer the heads, then capture what o_proj reads
                torch.ops.graphtap.steer_heads_(sink, site)
                torch.ops.graphtap.capture_resid_(sink, None, site)
            site = self.sites.id_for_slot(layer, PATTERN)
            if site is not None and tensors and tensors[0] is not None:
                torch.ops.graphtap.capture_pattern_(sink, tensors[0], site)
                torch.ops.graphtap.attention_mass_(sink, tensors[0], site)
            return
        for name, tensor in zip(("attn_q", "attn_k", "attn_v"), tensors):
            site = self.sites.id_for_slot(layer, name)
            if site is not None and tensor is not None and self.split.writes(name):
                torch.ops.graphtap.capture_into_(sink, tensor, site)

    # ---------------------------------------------------------------- requests
    def add_request(self, req_index, new_req_data) -> None:
        with named("graphtap.add_request"), self.clock.phase("add_request"):
            params = new_req_data.sampling_params
            spec = self.wire_specs(params.hooks if params is not None else None)
            for family in self.families:
                family.add_request(req_index, new_req_data.req_id, new_req_data.prompt_len, spec)
            # what may finish it, where its rows or chunks are held until then (probes:
            # only a request with probe entries holds its scores)
            probes = self.probes and bool(spec.probe)
            ending = Ending.of(params, new_req_data.prompt_len, self.max_len) \
                if params is not None and (probes or self.hold is not None) else None
            if probes and ending is not None:
                self.probe_family.hold(new_req_data.req_id, ending)
            self._guards.pop(new_req_data.req_id, None)
            if params is not None and params.stop and spec.captures_anything:
                self._stops.add(new_req_data.req_id)
            else:
                self._stops.discard(new_req_data.req_id)
            if self.hold is not None:
                self.hold.remove_request(new_req_data.req_id)
                if holds_outputs(spec, params, self.hold.max_bytes):
                    self.hold.add_request(new_req_data.req_id, ending)
            if spec.guard is not None:  # evaluated by the courier as the step's rows arrive
                self._guards[new_req_data.req_id] = (spec.guard, new_req_data.prompt_len)
            self.router.invalidate()  # the slot's meaning changed

    def remove_request(self, req_id) -> None:
        with named("graphtap.remove_request"), self.clock.phase("remove_request"):
            self._guards.pop(req_id, None)
            self._stops.discard(req_id)
            if self.hold is not None:  # unfinished (preempted, aborted): its chunks go
                self.hold.remove_request(req_id)
            for family in self.families:
                family.remove_request(req_id)

    def apply_staged_writes(self) -> None:
        with named("graphtap.apply_staged_writes"), self.clock.phase("apply_staged_writes"):
            # a routing replay applies them where there is one (engine/router.py)
            self.slots.apply(defer=self.router.takes_slot_writes())
            for family in self.families:
                family.apply_staged_writes()

    def bind_kv_caches(self, layers) -> None:
        for family in self.families:
            family.bind_kv_caches(layers)
        # after the memory profile's dummy steps: the routing graphs copy the runner's
        # positions from now (an engine without CUDA graphs gets no prepare_capture)
        self.router.adopt_positions()

    # ---------------------------------------------------------------- steps
    def prepare_step(self, input_batch, dummy_run) -> None:
        # its parts timed apart too (stats host.prepare_*): the host's share of a step
        # before the forward, which a burst's first steps wait for
        clock = self.clock
        if dummy_run:  # the runner's positions buffer, which the routing graphs copy
            self.router.learn_positions(input_batch.positions)
        with named("graphtap.prepare_step"), clock.phase("prepare_step"):
            with clock.phase("prepare_plan"):
                plans = [None] * len(self.families) if dummy_run else \
                    [family.plan(input_batch) for family in self.families]
            with clock.phase("prepare_route_tokens"):
                if any(plans):
                    # tok_pos is read by the z op and the staged row routing only: a
                    # step that steers the residual alone copies no positions
                    routing = [family.rows_to_route(plan) for family, plan
                               in zip(self.families, plans)
                               if plan and isinstance(family, RowFamily)]
                    # one family's rows: routed in the tokens' graph replay
                    self.router.route(input_batch, positions=bool(routing) or
                                      self.steer.steers_heads(input_batch),
                                      rows=routing[0] if len(routing) == 1 else None)
                else:
                    self.router.deactivate()
                self.slots.flush()  # what no replay took, before the rows' routing reads it
            with clock.phase("prepare_route_rows"):
                for family, plan in zip(self.families, plans):
                    if plan:
                        family.route(input_batch, self.router, plan)
                    else:
                        family.deactivate()

    def prepare_capture(self) -> None:
        self.slots.flush()
        self.router.adopt_positions()
        self.router.deactivate()
        for family in self.families:
            family.deactivate()

    def after_capture(self) -> None:
        # torch.cuda.graph emptied the pool init warmed, once per graph vLLM captured
        warmed = self._warm_pinned()
        if warmed:
            logger.info("graphtap: pinned pool warmed again after graph capture, %.1f MiB",
                        warmed / 2**20)

    def _warm_pinned(self) -> int:
        """Fills torch's pinned pool with the blocks a step's copies home ask for
        (courier/pinned.py); the bytes warmed, 0 where there is none to fill."""
        if self._device.type != "cuda" or not self.config.pinned_warm_bytes:
            return 0
        return warm_pinned_pool(max(f.host_copy_bytes() for f in self.families
                                    if isinstance(f, RowFamily)),
                                self.config.pinned_warm_bytes)

    def sink_sync(self) -> dict | None:
        """The sink's index once every row handed to it is on disk (None: this worker
        writes none); graphtap harvest asks after each run of prompts. A writer that
        stopped (a full disk) answers with its error beside the shards it wrote: an RPC
        that raised here would reach the engine core, not the caller."""
        if self.sink is None:
            return None
        try:
            return {"root": str(self.sink.root), **self.sink.sync()}
        except SinkFailed as e:
            return {"root": str(self.sink.root), **self.sink.written(), "error": str(e)}

    def stats(self) -> dict:
        """Per family what it holds now; GET /v1/graphtap/stats shows it per worker."""
        return {**{family.name: family.stats() for family in self.families},
                "guard": {"requests": len(self._guards)}, "routing": self.router.stats(),
                "host": self.clock.stats(),
                **({"hold": self.hold.stats()} if self.hold is not None else {}),
                **({"sink": self.sink.stats()} if self.sink is not None else {}),
                **_pinned_stats()}

    def host_timeline(self) -> list[tuple[str, float, float]]:
        """The hook manager's phase calls since the last look (profiling.HostClock)."""
        return self.clock.timeline()

    def collect(self, input_batch, dummy_run):
        if dummy_run:
            return None
        with named("graphtap.collect"), self.clock.phase("collect"):  # profile_capture.py
            parts = []
            for family in self.families:
                part = family.snapshot()
                if part is not None:  # a family's own set (rows and refusals) flattened
                    parts.extend(part.parts if isinstance(part, StepSnapshots) else [part])
            # a step without rows may still be the one that finishes a held request
            hold = self.hold if self.hold is not None and \
                self.hold.any_in(input_batch.req_ids) else None
            if not parts and hold is None:
                return None
            guards = {r: self._guards[r] for r in input_batch.req_ids if r in self._guards} \
                if self._guards else None
            held = hold is not None or any(getattr(p, "held", None) is not None for p in parts)
            inline = {r for r in input_batch.req_ids if r in self._stops} \
                if self._stops else None
            return StepSnapshots(parts, guards, StepBatch.of(input_batch) if held else None,
                                 hold, self.clock, inline, self.unsettled)
