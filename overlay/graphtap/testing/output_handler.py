"""AsyncLLM's own output handler without an engine: a stand-in engine core feeds it
messages, so tests and CPU benchmarks see what a message's outputs wait for in the
frontend (HookFrontend.output_slices, finish_outputs) as vLLM runs it."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace


class _Core:
    """The engine core client as the output handler uses it: `messages` in order, then
    nothing (the handler waits for a next one until it is cancelled)."""

    def __init__(self, messages):
        self.left = list(messages)

    async def get_output_async(self):
        if not self.left:
            await asyncio.Event().wait()
        return self.left.pop(0)

    async def abort_requests_async(self, request_ids) -> None:
        pass

    def shutdown(self, timeout=None) -> None:
        pass


def start_output_handler(output_processor, messages):
    """AsyncLLM's output handler task (`.output_handler` of the returned object; cancel
    it when done) processing `messages` (EngineCoreOutputs) into `output_processor`'s
    request queues. Call inside a running event loop."""
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.__new__(AsyncLLM)  # only its output handler runs
    llm.output_handler, llm.engine_core = None, _Core(messages)
    llm.output_processor, llm.log_stats, llm.logger_manager = output_processor, False, None
    llm.renderer = SimpleNamespace(mm_processor_cache=None, shutdown=lambda: None)
    llm._run_output_handler()
    return llm
