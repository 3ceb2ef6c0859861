"""What graphtap can honour, checked when an engine starts (frontend and worker alike):
an engine that would run some requests unhooked, or return rows nobody asked for, does
not start at all, and says why."""
from __future__ import annotations

# Decoder layers patch 0002 puts the slots in (Mistral uses Llama's layer).
WITH_SLOTS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def model_heads(model_config) -> tuple[int, int]:
    """(query heads, KV heads) of the whole model, whatever one rank holds: requests name
    heads as at TP=1 (engine/heads.py)."""
    return (model_config.model_arch_config.total_num_attention_heads,
            model_config.get_total_num_kv_heads())


def refuse_unsupported(vllm_config, config) -> None:
    """ValueError naming the setting graphtap cannot honour with a hook manager on
    (config: the engine's HookConfig)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    sites = config.site_table(mc.hf_text_config.num_hidden_layers).sites
    attention_sites = [s.name for s in sites if not s.is_residual]
    archs = list(getattr(mc, "architectures", None) or [])
    if not any(a in WITH_SLOTS for a in archs):
        # Without slots every spec would be accepted and do nothing.
        raise ValueError(f"hook_manager: {', '.join(archs) or 'this model'} has no hook slots "
                         f"(supported: {', '.join(WITH_SLOTS)})")
    if pc.pipeline_parallel_size > 1:
        # Each stage holds some layers and only the last stage's outputs return.
        raise ValueError("hook_manager: not supported with pipeline_parallel_size > 1")
    if vllm_config.speculative_config is not None:
        # Draft tokens run through the model and are rejected later: their rows and
        # steered KV would be counted as the request's.
        raise ValueError("hook_manager: not supported with speculative decoding "
                         "(speculative_config)")
    tp = pc.tensor_parallel_size
    if attention_sites and tp > 1:
        # Each rank holds a slice of the heads; their rows are summed over the ranks
        # (engine/heads.py), which needs the heads split as vLLM splits them.
        heads, kv = model_heads(mc)
        if heads % tp or (kv % tp and tp % kv):
            raise ValueError(f"hook_config.sites: {attention_sites[0]}: {heads} query heads "
                             f"and {kv} KV heads do not split over tensor_parallel_size={tp}")
