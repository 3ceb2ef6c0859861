"""Steering and capture parity with HF on tiny Qwen2, compiled (one engine for the module)."""
from steer_parity import *  # noqa: F401,F403  the shared tests
from steer_parity import engine_fixture

steer_engine = engine_fixture("qwen2", eager=False)
