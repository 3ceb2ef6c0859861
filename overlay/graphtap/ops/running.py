"""How a graph op finds its engine's tables when its Python body runs (eager steps, and
once at CUDA-graph capture): through vLLM's forward context, which the running engine's
runner sets for every forward and which holds that engine's hook manager, as it holds
its attention layers. Replayed graphs never get here: their kernels keep the addresses
captured. Nothing here is process state, so two engines in one process keep their own."""
from __future__ import annotations

from graphtap.ops.tables import OpTables


def running_tables(op: str) -> OpTables:
    # Imported here: the kernels and references stay importable without vLLM
    # (benchmarks/gpu/check_kernels.py runs them on a bare GPU machine).
    from vllm.v1.worker.gpu.hooks import current_hook_manager

    tables = getattr(current_hook_manager(), "op_tables", None)
    if tables is None:
        raise RuntimeError(f"graphtap::{op} ran in a forward whose engine has no graphtap "
                           f"hook manager (hook_manager='graphtap')")
    tables.python_calls[op] += 1
    return tables
