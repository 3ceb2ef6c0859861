"""Steering and capture parity with HF on tiny Llama, compiled (one engine for the module)."""
from steer_parity import *  # noqa: F401,F403  the shared tests
from steer_parity import engine_fixture

steer_engine = engine_fixture("llama", eager=False)
