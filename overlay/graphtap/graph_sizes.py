"""CUDA graph sizes that cover prefill steps, for throughput loads (a harvest).

vLLM captures piecewise graphs up to 512 tokens by default, so a prefill step of 2048
tokens runs its compiled pieces without a graph: every kernel is launched from the host,
and every hook op's Python body runs once per layer: on the H200 the host paced a
harvest (benchmarks/results, group llama3-8b-sink-overlap). Graphs up to the step's
token budget take the host out of those steps; the price is capture time and graph
memory at start, which a long harvest repays and a latency-bound server may not, so
`graphtap harvest` takes them on a GPU by default and a server only when asked
(`graphtap serve --prefill-graphs TOKENS`). Hook ops sit inside the pieces (placement is
static), so nothing of graphtap changes with the sizes."""
from __future__ import annotations

VLLM_DEFAULT_MAX = 512  # vLLM's own cap on its automatic sizes (CompilationConfig)


def vllm_default_sizes(up_to: int = VLLM_DEFAULT_MAX) -> list[int]:
    """vLLM's automatic capture sizes (CompilationConfig.max_cudagraph_capture_size's
    pattern), up to `up_to`."""
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, up_to + 1, 16))
    return [s for s in sizes if s <= up_to]


def prefill_graph_sizes(max_tokens: int, step: int = 256) -> list[int]:
    """vLLM's sizes up to 512, then every `step` tokens and the budget itself: a step of
    n <= max_tokens tokens replays a graph padded by less than `step` tokens (a full
    budget step, a harvest's usual one, by none)."""
    if max_tokens < 1 or step < 1:
        raise ValueError(f"prefill graphs: max_tokens ({max_tokens}) and step ({step}) "
                         f"must be positive")
    sizes = set(vllm_default_sizes(min(max_tokens, VLLM_DEFAULT_MAX)))
    sizes.update(range(VLLM_DEFAULT_MAX + step, max_tokens + 1, step))
    sizes.add(max_tokens)
    return sorted(sizes)


def prefill_compilation_config(max_tokens: int, step: int = 256) -> dict:
    """vLLM's compilation_config for prefill graphs (FULL graphs for decode batches as
    vLLM's default mode, piecewise ones for everything else up to `max_tokens`)."""
    return {"cudagraph_mode": "FULL_AND_PIECEWISE",
            "cudagraph_capture_sizes": prefill_graph_sizes(max_tokens, step)}
