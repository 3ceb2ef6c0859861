"""graphtap inside `vllm serve`: the routes of the named-vector registry and the request
body bound, attached by the OpenAI server through the hook manager's `attach_api`."""
from graphtap.server.app import attach

__all__ = ["attach"]
