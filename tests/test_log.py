"""graphtap's log lines reach vLLM's handler: vLLM configures the "vllm" logger only,
so loggers named after graphtap's modules printed nothing below WARNING (the start-up
lines of the hook manager and the routing graphs were missing from the engine's log)."""
import logging


def _reaches(log: logging.Logger, handlers) -> bool:
    node = log
    while node is not None:
        if any(h in handlers for h in node.handlers):
            return True
        if not node.propagate:
            return False
        node = node.parent
    return False


def test_graphtap_loggers_print_info_through_vllms_handler():
    from graphtap import frontend
    from graphtap.engine import manager, route_graphs

    handlers = logging.getLogger("vllm").handlers
    assert handlers  # vLLM's logging configuration, applied when vllm is imported
    for module in (manager, route_graphs, frontend):
        assert module.logger.isEnabledFor(logging.INFO), module.__name__
        assert _reaches(module.logger, handlers), module.logger.name
