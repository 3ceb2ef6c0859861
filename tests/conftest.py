import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports vLLM or Triton

import pytest

from graphtap.testing.tiny_models import tiny_model

PROMPTS = [
    "The quick brown fox",
    "Steering vectors shift the hidden state",
    "Prompt injection asks a model to ignore",
    "Numbers like 12, 40",
]


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    # Per test session, unless the caller points GRAPHTAP_TINY_CACHE at a shared folder.
    if os.environ.get("GRAPHTAP_TINY_CACHE"):
        return None
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def llama_path(tiny_cache):
    return tiny_model("llama", tiny_cache)


@pytest.fixture(scope="session")
def qwen2_path(tiny_cache):
    return tiny_model("qwen2", tiny_cache)
