"""The one seam into vLLM: the class that the entry point `vllm.hook_managers` names.

vLLM builds its worker half in Model Runner V2 (engine/manager.py) and asks it for the
frontend half, built in the frontend process (frontend.py): the two halves meet here and
nowhere else, so the engine never imports the frontend, nor the frontend the engine."""
from __future__ import annotations

from vllm.v1.worker.gpu.hooks import hook_config

from graphtap.config import load_hook_config
from graphtap.engine.manager import EngineHooks
from graphtap.frontend import GraphtapFrontend


class GraphtapHookManager(EngineHooks):
    """graphtap's hook manager (hook_manager="graphtap")."""

    @classmethod
    def frontend(cls, vllm_config) -> GraphtapFrontend:
        return GraphtapFrontend.for_engine(vllm_config, load_hook_config(hook_config(vllm_config)))

    @classmethod
    def attach_api(cls, app, args) -> None:
        from graphtap.server import attach

        attach(app, args)
