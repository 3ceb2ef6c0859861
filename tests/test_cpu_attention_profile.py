"""Patch 0001: CPU attention's profile run (attention skipped, no metadata) returns zeros,
as FlashAttention does, not its uninitialised output buffer. Engine start with hooks
configured failed with NaN logits in the dummy sampler run (issue 16, item 10): hook
buffers change what freed memory torch.empty hands back, and inf/NaN garbage reached
the sampler through the stream."""
import torch

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl


def test_profile_run_output_is_zeros_whatever_the_buffer_held():
    impl = CPUAttentionBackendImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2,
                                   alibi_slopes=None, sliding_window=None,
                                   kv_cache_dtype="auto")
    q = torch.randn(5, 4 * 64)
    kv = torch.randn(5, 2 * 64)
    output = torch.full((5, 4 * 64), float("nan"))
    output[1] = float("inf")
    out = impl.forward(None, q, kv, kv, torch.empty(0), None, output)
    assert torch.equal(out, torch.zeros_like(out))
