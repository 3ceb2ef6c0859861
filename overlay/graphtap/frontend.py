"""The frontend half of the hook manager (vLLM's frontend process): validate and
normalise specs, salt the prefix cache, keep the resident vector table from overflowing
by refusing requests at admission, and hand a finished request's chunks to the courier."""
from __future__ import annotations

import threading
from collections import Counter

from vllm.exceptions import VLLMValidationError
from vllm.v1.worker.gpu.hooks import HookFrontend

from graphtap.config import HookConfig
from graphtap.courier import assemble
from graphtap.outputs import HookOutputs
from graphtap.spec import ModelShape, NormalisedSpec, combined_salt, normalise, parse_spec


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
        max_steers=config.max_steers, max_vectors=config.max_vectors,
        max_captures=config.max_captures,
        num_heads=mc.get_num_attention_heads(vllm_config.parallel_config),
        num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
        save_root=config.save_root)


class GraphtapFrontend(HookFrontend):
    """Implements vLLM's HookFrontend for one engine."""

    def __init__(self, shape: ModelShape):
        self.shape = shape
        # Distinct vectors of live requests, refcounted: the worker holds exactly these
        # (or fewer), so admitting only what fits means the worker never overflows.
        self._lock = threading.Lock()
        self._live: dict[str, set[str]] = {}
        self._refs: Counter[str] = Counter()
        self._save_to: dict[str, str] = {}

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
        spec = normalise(parse_spec(raw), self.shape)
        if spec.captures_anything and getattr(params, "n", 1) > 1:
            # Each sample is its own engine request, but RequestOutput.hooks has room for
            # one set of captures: refuse rather than return one sample's rows silently.
            raise ValueError("hooks.capture: not supported with n > 1 (parallel sampling); "
                             "send one request per sample")
        params.hooks = spec.to_wire()
        if spec.captures_anything:
            # Prompt positions served from the prefix cache never run through the model,
            # so a capturing request recomputes its prompt (it still writes the cache).
            params.skip_reading_prefix_cache = True
        return combined_salt(cache_salt, spec)

    def admit_request(self, request) -> None:
        params = request.sampling_params
        spec = NormalisedSpec.from_wire(params.hooks if params is not None else None)
        keys = {s.key for s in spec.steer}
        with self._lock:
            new = [k for k in keys if self._refs[k] == 0]
            held = sum(1 for n in self._refs.values() if n > 0)
            if held + len(new) > self.shape.max_vectors:
                raise HookSpecError(
                    f"hooks.steer: this request needs {len(new)} new resident vector(s) and "
                    f"live requests hold {held} of the {self.shape.max_vectors} slots "
                    f"(hook_config.max_vectors); retry when some finish, or raise the limit")
            if keys:
                self._live[request.request_id] = keys
                self._refs.update(keys)
            if spec.save_to:
                self._save_to[request.request_id] = spec.save_to

    def release_request(self, request_id: str) -> None:
        with self._lock:
            self._save_to.pop(request_id, None)  # aborted before it finished
            keys = self._live.pop(request_id, None)
            if keys:
                self._refs.subtract(keys)
                for k in keys:
                    if self._refs[k] <= 0:
                        del self._refs[k]

    def finish_outputs(self, request_id: str, chunks) -> HookOutputs:
        with self._lock:
            save_to = self._save_to.pop(request_id, None)
        return assemble(request_id, chunks, save_to)
