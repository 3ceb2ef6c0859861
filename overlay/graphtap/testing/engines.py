"""Engine and reference helpers shared by the tests, the demo and the CPU benchmarks."""
from __future__ import annotations

import gc
import os
from pathlib import Path

from graphtap.devices import has_gpu
from graphtap.runner_info import WORKER_EXTENSION


def _use_triton_interpreter() -> bool:
    """Only without a GPU: on one, the interpreter would run every kernel on the host."""
    return not has_gpu()


# Must be set before vLLM (and so Triton) is imported anywhere in the process, and it is
# inherited by vLLM's engine-core and worker processes.
if "TRITON_INTERPRET" not in os.environ and _use_triton_interpreter():
    os.environ["TRITON_INTERPRET"] = "1"

CPU_DEFAULTS = dict(dtype="float32", gpu_memory_utilization=0.3, max_model_len=512, seed=0,
                    max_num_seqs=16)


def make_llm(model: Path | str, *, eager: bool = True, **kwargs):
    """An offline vLLM engine with graphtap's runner probe; CPU-friendly defaults."""
    from vllm import LLM

    args = {**CPU_DEFAULTS, "enforce_eager": eager, "worker_extension_cls": WORKER_EXTENSION,
            **kwargs}
    return LLM(str(model), **args)


def runner_info(llm) -> dict:
    infos = llm.collective_rpc("graphtap_runner_info")
    return infos[0]


def shutdown(llm) -> None:
    """Stop the engine's processes now, so the next test module starts from a quiet machine."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()


def hf_greedy(model: Path | str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers greedy continuation: the reference for token parity."""
    from graphtap.testing.hf_reference import hf_generate

    return hf_generate(_hf_model(str(model)), prompt_ids, max_new_tokens)[0]


_HF_CACHE: dict[str, object] = {}


def _hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    if path not in _HF_CACHE:
        _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF_CACHE[path]


def tokenize(model: Path | str, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
