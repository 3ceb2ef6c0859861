"""What graphtap can honour, checked when an engine starts (frontend and worker alike):
an engine that would run some requests unhooked, or return rows nobody asked for, does
not start at all, and says why."""
from __future__ import annotations

# Decoder layers patch 0002 puts the slots in (Mistral uses Llama's layer).
WITH_SLOTS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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
    if attention_sites and pc.tensor_parallel_size > 1:
        # Each rank holds a slice of the heads and only rank 0's output returns.
        raise ValueError(f"hook_config.sites: attention sites ({attention_sites[0]}, ...) need "
                         f"tensor_parallel_size=1; graphtap does not gather heads across "
                         f"ranks yet (residual sites work with any TP size)")
