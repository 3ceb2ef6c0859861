"""The worker's hook manager and the frontend's hook side without an engine: built from a
stand-in for vLLM's config (the fields they read), on the CPU, for unit tests and the CPU
benchmarks of the per-request and per-step host paths."""
from __future__ import annotations

from types import SimpleNamespace as NS

import torch


def cpu_hook_manager(sites: list[str], *, layers: int, hidden: int, heads: int, kv_heads: int,
                     head_dim: int, max_len: int, max_num_seqs: int, batched_tokens: int,
                     dtype: torch.dtype = torch.float32, graph_tokens: int = 16,
                     **hook_config):
    """(EngineHooks, GraphtapFrontend) of one Llama-shaped model, `hook_config` beside
    the sites (max_captures, capture_rows, ...)."""
    from graphtap.config import load_hook_config
    from graphtap.engine.manager import EngineHooks
    from graphtap.frontend import GraphtapFrontend

    mc = NS(hf_text_config=NS(num_hidden_layers=layers), get_hidden_size=lambda: hidden,
            dtype=dtype, max_model_len=max_len, get_head_size=lambda: head_dim,
            architectures=["LlamaForCausalLM"],
            model_arch_config=NS(total_num_attention_heads=heads),
            get_total_num_kv_heads=lambda: kv_heads)
    config = {"sites": sites, **hook_config}
    cfg = NS(model_config=mc,
             scheduler_config=NS(max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=batched_tokens),
             compilation_config=NS(max_cudagraph_capture_size=graph_tokens),
             parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1,
                                data_parallel_size=1, _api_process_count=1),
             speculative_config=None, device_config=NS(device_type="cpu"),
             additional_config={"hook_config": config})
    return EngineHooks(cfg, None, "cpu"), GraphtapFrontend.for_engine(cfg, load_hook_config(config))
