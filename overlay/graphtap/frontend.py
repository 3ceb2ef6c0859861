"""The frontend half of the hook manager: validate specs, salt the prefix cache, and keep
the resident vector table from overflowing by refusing requests at admission."""
from __future__ import annotations

import threading
from collections import Counter

from vllm.exceptions import VLLMValidationError
from vllm.v1.worker.gpu.hooks import HookFrontend

from graphtap.config import HookConfig
from graphtap.spec import ModelShape, normalise, parse_spec, steering_salt


class HookSpecError(VLLMValidationError, ValueError):
    """A bad hook spec: a ValueError for Python callers, and a client error (HTTP 400)
    for vLLM's OpenAI server, which answers a plain ValueError with a 500."""

    def __init__(self, message: str):
        super().__init__(message, parameter=message.split(":", 1)[0])


def model_shape(vllm_config, config: HookConfig) -> ModelShape:
    mc = vllm_config.model_config
    num_layers = mc.hf_text_config.num_hidden_layers
    return ModelShape(
        num_layers=num_layers, hidden_size=mc.get_hidden_size(), max_model_len=mc.max_model_len,
        configured_sites={s.name for s in config.site_table(num_layers).sites},
        max_steers=config.max_steers, max_vectors=config.max_vectors)


class GraphtapFrontend(HookFrontend):
    def __init__(self, shape: ModelShape):
        self.shape = shape
        # Distinct vectors of live requests, refcounted: the worker holds exactly these
        # (or fewer), so admitting only what fits means the worker never overflows.
        self._lock = threading.Lock()
        self._live: dict[str, set[str]] = {}
        self._refs: Counter[str] = Counter()

    def process_request(self, request_id, params, cache_salt):
        try:
            return self._process(params, cache_salt)
        except HookSpecError:
            raise
        except ValueError as e:
            raise HookSpecError(str(e)) from None

    def _process(self, params, cache_salt):
        raw = params.hooks
        if raw is None and params.extra_args and "hooks" in params.extra_args:
            raw = params.extra_args.pop("hooks")  # HTTP: vllm_xargs={"hooks": "<json>"}
        if not raw:
            params.hooks = None
            return cache_salt
        normalised = normalise(parse_spec(raw), self.shape)
        params.hooks = normalised
        salt = steering_salt(normalised)
        if salt is None:
            return cache_salt
        return f"{cache_salt}|graphtap:{salt}" if cache_salt else f"graphtap:{salt}"

    def admit_request(self, request) -> None:
        hooks = request.sampling_params.hooks if request.sampling_params else None
        keys = {s["key"] for s in (hooks or {}).get("steer", [])}
        if not keys:
            return
        with self._lock:
            new = [k for k in keys if self._refs[k] == 0]
            held = sum(1 for k, n in self._refs.items() if n > 0)
            if held + len(new) > self.shape.max_vectors:
                raise HookSpecError(
                    f"hooks.steer: this request needs {len(new)} new resident vector(s) and "
                    f"live requests hold {held} of the {self.shape.max_vectors} slots "
                    f"(hook_config.max_vectors); retry when some finish, or raise the limit")
            self._live[request.request_id] = keys
            self._refs.update(keys)

    def release_request(self, request_id: str) -> None:
        with self._lock:
            keys = self._live.pop(request_id, None)
            if keys:
                self._refs.subtract(keys)
                for k in keys:
                    if self._refs[k] <= 0:
                        del self._refs[k]
