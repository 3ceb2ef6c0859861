"""The frontend half of the hook manager: validate specs, salt the prefix cache, and keep
the resident vector table from overflowing by refusing requests at admission."""
from __future__ import annotations

import os
import threading
from collections import Counter

import torch

from vllm.exceptions import VLLMValidationError
from vllm.v1.worker.gpu.hooks import HookFrontend, merge_hook_chunks

from graphtap.courier import BOUND_SHORT, OVERFLOW_KEY
from graphtap.config import HookConfig
from graphtap.outputs import HookOutputs
from graphtap.pattern_scheduler import unpack_patterns
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
        max_steers=config.max_steers, max_vectors=config.max_vectors,
        max_captures=config.max_captures,
        num_heads=mc.get_num_attention_heads(vllm_config.parallel_config),
        num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
        save_root=config.save_root)


class GraphtapFrontend(HookFrontend):
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
        normalised = normalise(parse_spec(raw), self.shape)
        if normalised["capture"] and getattr(params, "n", 1) > 1:
            # Each sample is its own engine request, but RequestOutput.hooks has room for
            # one set of captures: refuse rather than return one sample's rows silently.
            raise ValueError("hooks.capture: not supported with n > 1 (parallel sampling); "
                             "send one request per sample")
        params.hooks = normalised
        if normalised["capture"]:
            # Prompt positions served from the prefix cache never run through the model,
            # so a capturing request recomputes its prompt (it still writes the cache).
            params.skip_reading_prefix_cache = True
        salt = steering_salt(normalised)
        if salt is None:
            return cache_salt
        return f"{cache_salt}|graphtap:{salt}" if cache_salt else f"graphtap:{salt}"

    def admit_request(self, request) -> None:
        hooks = request.sampling_params.hooks if request.sampling_params else None
        keys = {s["key"] for s in (hooks or {}).get("steer", [])}
        with self._lock:
            new = [k for k in keys if self._refs[k] == 0]
            held = sum(1 for k, n in self._refs.items() if n > 0)
            if held + len(new) > self.shape.max_vectors:
                raise HookSpecError(
                    f"hooks.steer: this request needs {len(new)} new resident vector(s) and "
                    f"live requests hold {held} of the {self.shape.max_vectors} slots "
                    f"(hook_config.max_vectors); retry when some finish, or raise the limit")
            if keys:
                self._live[request.request_id] = keys
                self._refs.update(keys)
            if hooks and hooks.get("save_to"):
                self._save_to[request.request_id] = hooks["save_to"]

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
        """Merge a finished request's pieces: rows in position order, the last row kept
        where a position ran twice (recomputation after preemption)."""
        merged = merge_hook_chunks(chunks) or {}
        with self._lock:
            save_to = self._save_to.pop(request_id, None)
        if OVERFLOW_KEY in merged:
            wanted, capacity, kind = merged[OVERFLOW_KEY][:3].tolist()  # the first report
            if kind == BOUND_SHORT:
                return HookOutputs(error=(
                    f"hooks.capture: graphtap bug: a step wrote {wanted} rows where the "
                    f"host expected at most {capacity}; this request's captures were "
                    f"withheld rather than returned incomplete (please report it)"))
            what = ("attention-pattern rows", "pattern_rows") if kind else \
                ("capture rows", "capture_rows")
            return HookOutputs(error=(
                f"hooks.capture: a step needed {wanted} {what[0]} and the buffer holds "
                f"{capacity} (hook_config.{what[1]}); this request's captures are "
                f"incomplete and were withheld"))
        out = HookOutputs()
        for name in [n for n in merged if not n.endswith("@positions")]:
            rows, pos = merged[name], merged[f"{name}@positions"]
            if name.endswith(".attn.hook_pattern"):
                rows = unpack_patterns(rows, pos)
            if len(pos) > 1 and not bool((pos[1:] > pos[:-1]).all()):
                # Out of order or repeated: only after recomputation (preemption) or
                # chunks arriving out of step order. A gather copies every row, so the
                # usual, ordered case skips it (merge_hook_chunks copied them already).
                order = torch.argsort(pos, stable=True)
                rows, pos = rows[order], pos[order]
                keep = torch.ones_like(pos, dtype=torch.bool)
                keep[:-1] = pos[1:] != pos[:-1]  # the last of equal positions wins
                rows, pos = rows[keep], pos[keep]
            out[name], out.positions[name] = _own(rows), _own(pos)
        if save_to:
            self._save(save_to, request_id, out)
        return out

    @staticmethod
    def _save(directory: str, request_id: str, out: HookOutputs) -> None:
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        tensors = {**out, **{f"{k}.positions": v for k, v in out.positions.items()}}
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in request_id)
        save_file(tensors, os.path.join(directory, f"{safe}.safetensors"))


def _own(t: torch.Tensor) -> torch.Tensor:
    """t in storage of its own. A single-chunk capture can still be a view of a whole
    step's rows (the worker splits steps into views; in-process engines pass them on
    unserialised), which would keep that step alive as long as the caller keeps this."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)
