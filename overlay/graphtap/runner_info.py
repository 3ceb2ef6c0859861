"""What actually ran inside the worker: which model runner, compile mode and graph mode.

vLLM falls back to its V1 runner silently (no Triton, unsupported features), and the
V1 runner has none of graphtap's hook slots, so tests and the demo ask the worker itself
rather than trusting the frontend's config. Plugged in with vLLM's own
`worker_extension_cls` engine argument and called through `collective_rpc`.
"""
from __future__ import annotations

WORKER_EXTENSION = "graphtap.runner_info.RunnerInfoExtension"


class RunnerInfoExtension:
    """Mixed into vLLM's Worker class by `worker_extension_cls`."""

    def graphtap_runner_info(self) -> dict:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

        runner = self.model_runner  # type: ignore[attr-defined]
        config = runner.vllm_config.compilation_config
        module = type(runner).__module__
        return {
            "runner_class": f"{module}.{type(runner).__qualname__}",
            "model_runner_v2": isinstance(runner, V2Runner),
            "compilation_mode": _name(config.mode),
            "cudagraph_mode": _name(config.cudagraph_mode),
            # How often each graphtap op's Python body ran in this worker: inside
            # replayed CUDA graphs it never runs.
            "op_python_calls": dict(getattr(runner.hooks, "op_tables", None).python_calls)
            if hasattr(runner.hooks, "op_tables") else {},
        }

    def graphtap_hook_stats(self) -> dict:
        """What the worker's hook families hold now (graphtap.engine.manager.stats)."""
        hooks = self.model_runner.hooks  # type: ignore[attr-defined]
        return hooks.stats() if hasattr(hooks, "stats") else {}

    def graphtap_host_timeline(self) -> list:
        """The hook manager's phase calls since the last call, on CLOCK_MONOTONIC (the
        clock of vLLM's request timestamps): [phase, start s, wall ms] each."""
        hooks = self.model_runner.hooks  # type: ignore[attr-defined]
        return hooks.host_timeline() if hasattr(hooks, "host_timeline") else []

    def graphtap_sink_sync(self) -> dict | None:
        """The bulk sink's index once all its rows are written (engine.manager.sink_sync):
        None on a worker that writes no sink."""
        hooks = self.model_runner.hooks  # type: ignore[attr-defined]
        return hooks.sink_sync() if hasattr(hooks, "sink_sync") else None


def _name(value) -> str:
    return getattr(value, "name", str(value))
