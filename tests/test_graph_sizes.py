"""CUDA graph sizes for prefill steps (graphtap/graph_sizes.py): vLLM's own sizes up to
512, then a graph every `step` tokens up to the step budget, so every step of n tokens
replays a graph padded by less than `step` tokens, and a full step by none."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphtap.graph_sizes import prefill_graph_sizes, vllm_default_sizes


@given(max_tokens=st.integers(1, 20000), step=st.integers(1, 1024),
       n=st.integers(1, 20000))
def test_every_step_up_to_the_budget_has_a_graph_padded_by_less_than_a_step(
        max_tokens, step, n):
    sizes = prefill_graph_sizes(max_tokens, step)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens and sizes[0] >= 1
    assert [s for s in sizes if s <= 512] == vllm_default_sizes(min(max_tokens, 512)) + (
        [max_tokens] if max_tokens <= 512 and max_tokens not in vllm_default_sizes() else [])
    n = min(n, max_tokens)
    padded = min(s for s in sizes if s >= n)
    assert padded - n < max(step, 16)  # vLLM's own sizes are 16 apart above 256


def test_vllm_default_sizes_match_vllm():
    """The same pattern vLLM's CompilationConfig documents for its automatic sizes."""
    sizes = vllm_default_sizes()
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512 and len(sizes) == 51


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="max_tokens"):
        prefill_graph_sizes(0)
