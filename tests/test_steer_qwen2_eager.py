"""Steering parity with HF on tiny Qwen2, eager (one engine for the module)."""
import pytest

from graphtap.testing.engines import make_llm, shutdown
from steer_parity import *  # noqa: F401,F403  the shared tests
from steer_parity import ENGINE_SITES


@pytest.fixture(scope="module")
def steer_engine(qwen2_path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(qwen2_path)
    llm = make_llm(qwen2_path, eager=True, hook_manager="graphtap",
                   hook_config={"sites": ENGINE_SITES})
    yield llm, qwen2_path, cfg.hidden_size, cfg.num_hidden_layers
    shutdown(llm)
