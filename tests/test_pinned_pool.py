"""The pinned host pool warmed at engine start (courier/pinned.py, hook_config
pinned_warm_bytes): every power-of-two block size a step's copies home may ask for,
smallest first within the budget, `depth` blocks of each held at once so the pool keeps
that many. The pool itself is torch's (CUDA only): the GPU launches show whether a
burst's first capture step still allocates (benchmarks/gpu, host clock's to_cpu and
collect)."""
import pytest
import torch

from graphtap.courier.pinned import DEPTH, FLOOR, buckets, warm_pinned_pool, warm_plan


def test_buckets_reach_the_block_that_holds_the_largest_copy():
    assert buckets(0) == buckets(FLOOR) == [FLOOR]
    assert buckets(3000) == [512, 1024, 2048, 4096]
    assert buckets(4096) == [512, 1024, 2048, 4096]
    assert buckets(4097)[-1] == 8192


def test_plan_keeps_to_the_budget_smallest_first():
    mib = 2**20
    plan = warm_plan(256 * mib, 192 * mib, depth=3)
    assert plan[0] == FLOOR and plan[-1] == 32 * mib  # 64 MiB x 3 would pass 192 MiB
    assert sum(3 * s for s in plan) <= 192 * mib
    assert warm_plan(1 * mib, 192 * mib) == buckets(1 * mib)  # all of a small family's
    assert warm_plan(1 * mib, 0) == []


def test_every_block_is_held_at_once_then_freed():
    live, most, sizes = [0], [0], []

    class Block:
        def __init__(self, n):
            self.n = n
            live[0] += 1
            most[0] = max(most[0], live[0])
            sizes.append(n)

        def numel(self):
            return self.n

        def __del__(self):
            live[0] -= 1

    warmed = warm_pinned_pool(5000, budget=1 << 20, alloc=Block)
    assert sorted(set(sizes)) == [512, 1024, 2048, 4096, 8192]
    assert all(sizes.count(s) == DEPTH for s in set(sizes))
    assert most[0] == len(sizes)  # the pool makes DEPTH blocks of a size, not one reused
    assert live[0] == 0 and warmed == DEPTH * (512 + 1024 + 2048 + 4096 + 8192)


def test_budget_option_is_checked():
    from graphtap.config import load_hook_config

    assert load_hook_config({}).pinned_warm_bytes == 128 * 2**20
    assert load_hook_config({"pinned_warm_bytes": 0}).pinned_warm_bytes == 0
    with pytest.raises(ValueError, match="pinned_warm_bytes"):
        load_hook_config({"pinned_warm_bytes": -1})


def test_default_budget_reaches_a_qk_prefill_steps_copy():
    """8 requests x 256 k rows x 4 layers x 4 heads x 128 bf16 values: 8 MiB, in a
    16 MiB block, four of them."""
    from graphtap.config import load_hook_config

    plan = warm_plan(1 << 30, load_hook_config({}).pinned_warm_bytes)
    assert plan[-1] == 16 * 2**20 >= 8 * 256 * 4 * 4 * 128 * 2


def test_the_pool_is_warmed_again_once_vllm_has_captured_its_graphs():
    """torch.cuda.graph empties torch's pinned host cache as each capture begins, and
    Model Runner V2 captures its graphs after the hook manager's init (its warm-up):
    the runner calls HookManager.after_capture once they are captured (patch 0003),
    where graphtap's manager warms the pool again. On the CPU there is no pool to warm."""
    import inspect

    from vllm.v1.worker.gpu.hooks import NO_OP_HOOKS
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    source = inspect.getsource(GPUModelRunner.capture_model)
    assert source.index("self.cudagraph_manager.capture(") < \
        source.index("self.hooks.after_capture()") < source.index("return cuda_graph_size")
    NO_OP_HOOKS.after_capture()  # stock vLLM's manager: nothing

    from graphtap.testing.hook_manager import cpu_hook_manager

    manager, _ = cpu_hook_manager(["blocks.0.hook_resid_post"], layers=2, hidden=8, heads=2,
                                  kv_heads=2, head_dim=4, max_len=64, max_num_seqs=4,
                                  batched_tokens=32)
    manager.after_capture()
    assert manager._warm_pinned() == 0


def test_a_small_steps_copies_home_share_one_block():
    """host_copies: each tensor's values, 16-byte aligned parts of one host block (one
    pinned allocation on the busy loop for the head and the rows)."""
    from graphtap.engine.rows import host_copies

    head = torch.arange(7, dtype=torch.int32)
    rows = torch.randn(3, 5).to(torch.bfloat16)
    h, r = host_copies(head, rows)
    assert torch.equal(h, head) and torch.equal(r, rows)
    assert h.untyped_storage().data_ptr() == r.untyped_storage().data_ptr()
    assert r.data_ptr() % 16 == 0 and r.shape == rows.shape and r.dtype == rows.dtype
    empty, = host_copies(torch.zeros(0, 4))
    assert empty.shape == (0, 4)
