"""graphtap's loggers, as children of vLLM's: vLLM's logging configuration gives the
"vllm" logger its handler and level (VLLM_LOGGING_LEVEL) and nothing else, so a logger
named after graphtap's own modules printed only warnings and errors, through Python's
last-resort handler, and graphtap's start-up lines (its sites, families and tables,
whether the routing graphs were captured) never reached the engine's log."""
from __future__ import annotations

import logging

from vllm.logger import init_logger


def get_logger(name: str) -> logging.Logger:
    """The logger of graphtap module `name` (pass __name__), under "vllm"."""
    return init_logger(f"vllm.{name}")
