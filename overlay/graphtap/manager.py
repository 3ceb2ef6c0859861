"""graphtap's hook manager: the one seam into vLLM (entry point `vllm.hook_managers`).

Wires config, sites, tables, scheduler and ops, and owns their lifetimes. It is built by
the runner right after the model (before profiling, compile and capture), so every table
exists, at its final address, before the first trace.
"""
from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.hook_slots import (
    bind_attention_hook,
    bind_residual_hook,
    hook_layer_index,
)
from vllm.v1.worker.gpu.hooks import HookManager, hook_config

import graphtap.ops.capture  # noqa: F401  registers graphtap::capture_resid_
import graphtap.ops.pattern  # noqa: F401  registers graphtap::capture_pattern_
import graphtap.ops.steer  # noqa: F401  registers graphtap::steer_resid_ before any trace
from graphtap.capture_scheduler import CaptureScheduler
from graphtap.courier import StepSnapshots
from graphtap.config import load_hook_config
from graphtap.frontend import GraphtapFrontend, model_shape
from graphtap.ops.capture import bind_capture_tables
from graphtap.ops.pattern import KeyCache, bind_key_caches, bind_pattern_tables, key_cache_view
from graphtap.pattern_scheduler import PATTERN, PatternScheduler
from graphtap.ops.steer import bind_tables
from graphtap.scheduler import SteerScheduler
from graphtap.sites import RESID_KINDS
from graphtap.tables import CaptureTables, PatternTables, SteerTables

logger = init_logger(__name__)


class GraphtapHookManager(HookManager):
    def __init__(self, vllm_config, model, device):
        super().__init__(vllm_config, model, device)
        self.config = load_hook_config(hook_config(vllm_config))
        mc, sc = vllm_config.model_config, vllm_config.scheduler_config
        self.sites = self.config.site_table(mc.hf_text_config.num_hidden_layers)
        cc = vllm_config.compilation_config
        max_tokens = max(sc.max_num_batched_tokens, cc.max_cudagraph_capture_size or 0)
        self.tables = SteerTables.allocate(
            max_reqs=sc.max_num_seqs, max_tokens=max_tokens, max_steers=self.config.max_steers,
            max_vectors=self.config.max_vectors, hidden=mc.get_hidden_size(),
            max_len=mc.max_model_len, dtype=mc.dtype, device=torch.device(device))
        pc = vllm_config.parallel_config
        attn_sites = [s.name for s in self.sites.sites if not s.is_residual]
        if attn_sites and pc.tensor_parallel_size > 1:
            # Each rank holds a slice of the heads and only rank 0's output returns.
            raise ValueError(f"hook_config.sites: attention sites ({attn_sites[0]}, ...) need "
                             f"tensor_parallel_size=1; graphtap does not gather heads across "
                             f"ranks yet (residual sites work with any TP size)")
        head_dim = mc.get_head_size()
        q_width = mc.get_num_attention_heads(pc) * head_dim
        kv_width = mc.get_num_kv_heads(pc) * head_dim
        widths = {**{k: (mc.get_hidden_size(), 0) for k in RESID_KINDS},
                  "attn_q": (q_width, head_dim), "attn_z": (q_width, head_dim),
                  "attn_k": (kv_width, head_dim), "attn_v": (kv_width, head_dim)}
        self.capture_tables = CaptureTables.allocate(
            max_reqs=sc.max_num_seqs, max_tokens=max_tokens, max_captures=self.config.max_captures,
            num_sites=len(self.sites), rows=self.config.capture_rows,
            hidden=max(w for w, _ in widths.values()), max_len=mc.max_model_len,
            device=torch.device(device), dtype=mc.dtype)
        self.scheduler = SteerScheduler(self.tables, self.sites, torch.device(device))
        self.capture = CaptureScheduler(self.capture_tables, self.sites, mc.max_model_len,
                                        mc.dtype, torch.device(device), widths)
        self.pattern = None
        if any(s.kind == PATTERN for s in self.sites.sites):
            ptables = PatternTables.allocate(
                max_reqs=sc.max_num_seqs, max_captures=self.config.max_captures,
                num_heads=mc.get_num_attention_heads(pc), rows=self.config.pattern_rows,
                max_len=mc.max_model_len, device=torch.device(device))
            self.pattern = PatternScheduler(ptables, self.sites, mc.max_model_len, mc.dtype,
                                            torch.device(device))
            bind_pattern_tables(ptables)
            logger.info("graphtap: attention-pattern buffer %.1f MiB", ptables.nbytes() / 2**20)
        self.vllm_config = vllm_config
        bind_tables(self.tables)
        bind_capture_tables(self.capture_tables)
        bind_residual_hook(self._residual_hook)
        bind_attention_hook(self._attention_hook)
        logger.info("graphtap: %d hook sites, steering tables %.1f MiB, capture buffer %.1f MiB",
                    len(self.sites), self.tables.nbytes() / 2**20,
                    self.capture_tables.nbytes() / 2**20)

    @classmethod
    def frontend(cls, vllm_config):
        config = load_hook_config(hook_config(vllm_config))
        return GraphtapFrontend(model_shape(vllm_config, config))

    def _residual_hook(self, layer, kind, positions, hidden_states, residual) -> None:
        # Runs at trace time: emits an op only for configured sites (static, not data).
        site = self.sites.id_for_slot(layer, kind)
        if site is None:
            return
        # The stream is residual + hidden_states; in the first layer's input, hidden_states
        # alone. Steer first, then capture what flows on.
        x, other = (hidden_states, None) if residual is None else (residual, hidden_states)
        torch.ops.graphtap.steer_resid_(x, other, positions, site)
        torch.ops.graphtap.capture_resid_(x, other, site)

    def _attention_hook(self, layer_name, kind, sink, *tensors) -> None:
        # Trace time, like _residual_hook: ops only at configured attention sites.
        layer = hook_layer_index(layer_name)
        if kind == "z":
            site = self.sites.id_for_slot(layer, "attn_z")
            if site is not None:
                torch.ops.graphtap.capture_resid_(sink, None, site)
            site = self.sites.id_for_slot(layer, PATTERN)
            if site is not None and tensors and tensors[0] is not None:
                torch.ops.graphtap.capture_pattern_(sink, tensors[0], site)
            return
        for name, tensor in zip(("attn_q", "attn_k", "attn_v"), tensors):
            site = self.sites.id_for_slot(layer, name)
            if site is not None and tensor is not None:
                torch.ops.graphtap.capture_into_(sink, tensor, site)

    def add_request(self, req_index, new_req_data) -> None:
        params = new_req_data.sampling_params
        hooks = params.hooks if params is not None else None
        self.scheduler.add_request(req_index, new_req_data.req_id, new_req_data.prompt_len, hooks)
        self.capture.add_request(req_index, new_req_data.req_id, new_req_data.prompt_len, hooks)
        if self.pattern is not None:
            self.pattern.add_request(req_index, new_req_data.req_id, new_req_data.prompt_len,
                                     hooks)

    def remove_request(self, req_id) -> None:
        self.scheduler.remove_request(req_id)
        self.capture.remove_request(req_id)
        if self.pattern is not None:
            self.pattern.remove_request(req_id)

    def bind_kv_caches(self, block_tables, kv_cache_config) -> None:
        """Give the pattern op each pattern layer's paged keys and block table."""
        if self.pattern is None:
            return
        group_of = {name: g for g, grp in enumerate(kv_cache_config.kv_cache_groups)
                    for name in grp.layer_names}
        layers = self.vllm_config.compilation_config.static_forward_context
        caches = {}
        for layer_name, layer in layers.items():
            site = self.sites.id_for_slot(hook_layer_index(layer_name), PATTERN)
            if site is None or layer_name not in group_of:
                continue
            impl = layer.impl
            if getattr(layer, "kv_cache_dtype", "auto") != "auto" or \
                    getattr(impl, "logits_soft_cap", None) or \
                    getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1)):
                raise ValueError(f"hook_config.sites: {self.sites.sites[site].name} needs a "
                                 f"plain causal attention with an unquantised KV cache")
            keys = key_cache_view(layer.kv_cache, _backend(layer), layer.head_size)
            caches[site] = KeyCache(keys, block_tables[group_of[layer_name]], float(impl.scale),
                                    layer.num_heads // layer.num_kv_heads)
        bind_key_caches(caches)

    def prepare_step(self, input_batch, dummy_run) -> None:
        with torch.profiler.record_function("graphtap.prepare_step"):
            self._prepare_step(input_batch, dummy_run)

    def _prepare_step(self, input_batch, dummy_run) -> None:
        # Host-side first: which requests capture in this step (a request that wants
        # only prompt positions costs nothing while it decodes).
        rows = self.capture.step_requests(input_batch, dummy_run)
        pattern_rows = [] if self.pattern is None else \
            self.pattern.step_requests(input_batch, dummy_run)
        now = {r for _, r, _ in rows} | {r for _, r, _ in pattern_rows}
        self.scheduler.prepare_step(input_batch, dummy_run, now.__contains__)
        self.capture.prepare_step(input_batch, self.tables.tok_slot, dummy_run, rows)
        if self.pattern is not None:
            self.pattern.prepare_step(input_batch, self.tables.tok_slot, self.tables.tok_row,
                                      dummy_run, pattern_rows)

    def prepare_capture(self) -> None:
        self.scheduler.deactivate()
        self.capture.prepare_step(None, self.tables.tok_slot, dummy_run=True)
        if self.pattern is not None:
            self.pattern.prepare_step(None, self.tables.tok_slot, self.tables.tok_row, True)

    def collect(self, input_batch, dummy_run):
        with torch.profiler.record_function("graphtap.collect"):  # profile_capture.py
            parts = [self.capture.collect(input_batch, dummy_run)]
            if self.pattern is not None:
                parts.append(self.pattern.collect(dummy_run))
            parts = [p for p in parts if p is not None]
            return StepSnapshots(parts) if parts else None


def _backend(layer) -> str:
    """Backend name, with the CPU kernel's ISA: its block interior layout depends on it."""
    name = layer.attn_backend.get_name()
    if name == "CPU_ATTN":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(layer.kv_cache.dtype, layer.kv_cache.shape[2], layer.head_size,
                            layer.kv_cache_dtype)
        name = f"{name}:{isa}"
    return name
