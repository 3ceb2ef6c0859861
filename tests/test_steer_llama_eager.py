"""Steering parity with HF on tiny Llama, eager (one engine for the module)."""
import pytest

from graphtap.testing.engines import make_llm, shutdown
from steer_parity import *  # noqa: F401,F403  the shared tests
from steer_parity import ENGINE_SITES


@pytest.fixture(scope="module")
def steer_engine(llama_path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(llama_path)
    llm = make_llm(llama_path, eager=True, hook_manager="graphtap",
                   hook_config={"sites": ENGINE_SITES})
    yield llm, llama_path, cfg.hidden_size, cfg.num_hidden_layers
    shutdown(llm)
