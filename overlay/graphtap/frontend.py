"""The frontend half of the hook manager (vLLM's frontend process): validate and
normalise specs, salt the prefix cache, keep the resident vector table from overflowing
by refusing requests at admission, and hand a finished request's chunks to the courier."""
from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict

import msgspec
import numpy as np

from vllm.exceptions import VLLMValidationError
from vllm.v1.worker.gpu.hooks import HookFrontend

from graphtap.config import HookConfig
from graphtap.courier import Saver, ShippedRows, assemble, holds_outputs, open_chunks
from graphtap.log import get_logger
from graphtap.outputs import HookOutputs
from graphtap.profiling import HostClock
from graphtap.spec import (ModelShape, NormalisedSpec, VectorRegistry, WireSpecs, combined_salt,
                           normalise, parse_spec)
from graphtap.spec.limits import SizePlan
from graphtap.support import model_heads, refuse_unsupported
from graphtap.wire import encode


logger = get_logger(__name__)
# normalised specs a frontend remembers (GraphtapFrontend._normalised), and the largest
# spec it remembers (in msgpack bytes: a 4096-float vector as a JSON list is 37 KB)
SPEC_CACHE, SPEC_CACHE_BYTES = 256, 64 << 10
WIRES = 64  # wire forms a remembered spec keeps (prompt lengths x max_tokens)


class HookSpecError(VLLMValidationError, ValueError):
    """A bad hook spec: a ValueError for Python callers, and a client error (HTTP 400)
    for vLLM's OpenAI server, which answers a plain ValueError with a 500."""

    def __init__(self, message: str):
        super().__init__(message, parameter=message.split(":", 1)[0])


def model_shape(vllm_config, config: HookConfig) -> ModelShape:
    mc = vllm_config.model_config
    num_layers = mc.hf_text_config.num_hidden_layers
    # every head of the model: requests name heads as at TP=1 (engine/heads.py)
    num_heads, num_kv_heads = model_heads(mc)
    return ModelShape(
        num_layers=num_layers, hidden_size=mc.get_hidden_size(), max_model_len=mc.max_model_len,
        configured_sites={s.name for s in config.site_table(num_layers).sites},
        max_steers=config.max_steers, max_vectors=config.max_vectors,
        max_captures=config.max_captures,
        num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=mc.get_head_size(), dtype=str(mc.dtype).removeprefix("torch."),
        save_root=config.save_root, sink=config.sink_dir is not None,
        max_response_rows=config.max_response_rows,
        max_response_bytes=config.max_response_bytes,
        max_live_capture_bytes=config.max_live_capture_bytes,
        save_quota_bytes=config.save_quota_bytes, max_probes=config.max_probes,
        probe_width=config.probe_width, max_spans=config.max_spans)


class GraphtapFrontend(HookFrontend):
    """Implements vLLM's HookFrontend for one engine."""

    def __init__(self, shape: ModelShape, vectors: VectorRegistry | None = None):
        self.shape = shape
        self.vectors = vectors if vectors is not None else VectorRegistry(shape.hidden_size, 256)
        # Distinct vectors of live requests, refcounted: the worker holds exactly these
        # (or fewer), so admitting only what fits means the worker never overflows.
        self._lock = threading.Lock()
        self._live: dict[str, set[str]] = {}
        self._refs: Counter[str] = Counter()
        # what finish_outputs needs per request: (spec, prompt length, whether the worker
        # holds its chunks until a step that may finish it: courier/held_chunks.py)
        self._finish: dict[str, tuple[NormalisedSpec, int, bool]] = {}
        self.hold_bytes = 0  # the engine's hook_config.hold_outputs_bytes
        self._bytes: dict[str, int] = {}  # live requests' capture byte estimates
        self.api_servers = 1  # API server processes, each with a frontend of its own
        # spec text -> its normalised spec (see _normalised), least recently used first
        # (with its SizePlan: what it may return, per request's lengths)
        self._specs: OrderedDict[tuple[bytes, int], tuple[NormalisedSpec, SizePlan]] = \
            OrderedDict()
        self.saver = Saver(shape.save_root, shape.save_quota_bytes)
        # this frontend's host time: on the output handler a capturing request's finish
        # and a shipped step's arrival (arrived), on the split thread its split (a token
        # that waits in the output handler waits for the first two)
        self.clock = HostClock()
        self.wire_specs = WireSpecs()  # admission reads back what _process wrote
        self.shipped = ShippedRows(self._capturing, self.clock)  # courier/shipped.py

    @classmethod
    def for_engine(cls, vllm_config, config: HookConfig) -> "GraphtapFrontend":
        refuse_unsupported(vllm_config, config)
        shape = model_shape(vllm_config, config)
        vectors = VectorRegistry(shape.hidden_size, config.max_registered_vectors)
        if config.vectors_dir:
            try:
                vectors.load_dir(config.vectors_dir)
            except ValueError as e:
                raise ValueError(f"hook_config.vectors_dir: {e}") from None
        frontend = cls(shape, vectors)
        frontend.api_servers = vllm_config.parallel_config._api_process_count
        frontend.hold_bytes = config.hold_outputs_bytes
        return frontend

    def process_request(self, request_id, params, cache_salt, prompt_len=0):
        # AsyncLLM processes raw prompts one by one on a worker thread while its event
        # loop sends each finished one to the engine core. Pure-Python spec work keeps
        # the GIL across requests, so the loop got it only at the 5 ms switch interval
        # and a burst's first requests reached the engine 5-20 ms late (an H200 burst of
        # 64: capture requests queued at 13-29 ms, steer ones, whose hashing releases
        # the GIL, at 3-5 ms). Yielding it here lets the loop send the previous request
        # now. Not on the main thread (the API server's event loop, LLM): nothing waits.
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0)
        try:
            return self._process(params, cache_salt, prompt_len)
        except HookSpecError:
            raise
        except ValueError as e:
            raise HookSpecError(str(e)) from None

    def _process(self, params, cache_salt, prompt_len: int):
        raw = params.hooks
        if raw is None and params.extra_args and "hooks" in params.extra_args:
            # HTTP: vllm_xargs={"hooks": "<json>"}. The prompts of one request share one
            # extra_args dict (shallow copies of its params): this request gets a dict of
            # its own rather than taking the spec from the others.
            raw = params.extra_args["hooks"]
            params.extra_args = {k: v for k, v in params.extra_args.items() if k != "hooks"}
        if not raw:
            params.hooks = None
            return combined_salt(cache_salt, NormalisedSpec())  # namespaced all the same
        spec, plan, salts, wires = self._normalised(raw)
        if spec.captures_anything and getattr(params, "n", 1) > 1:
            # Each sample is its own engine request, but RequestOutput.hooks has room for
            # one set of captures: refuse rather than return one sample's rows silently.
            raise ValueError("hooks.capture: not supported with n > 1 (parallel sampling); "
                             "send one request per sample")
        # the wire form per (prompt length, max_tokens), made once: requests share it
        # (nothing changes it in place; SamplingParams.clone shares it too)
        shape = (prompt_len, params.max_tokens or 1)
        with self._lock:
            wired = wires.get(shape)
        if wired is None:
            size = plan.check(*shape)  # may raise: not kept
            spec = msgspec.structs.replace(spec, capture_bytes=size)
            wired = spec, spec.to_wire()
            with self._lock:
                wires[shape] = wired
                if len(wires) > WIRES:
                    del wires[next(iter(wires))]  # the oldest
        spec, params.hooks = wired
        if spec.captures_anything:
            # Prompt positions served from the prefix cache never run through the model,
            # so a capturing request recomputes its prompt (it still writes the cache).
            params.skip_reading_prefix_cache = True
        return combined_salt(cache_salt, spec, prompt_len, salts)

    def _normalised(self, raw) -> tuple[NormalisedSpec, SizePlan, dict, dict]:
        """parse_spec + normalise, the spec's SizePlan, its steering salts (a memo of
        combined_salt) and its wire forms (per prompt length and max_tokens), remembered
        per spec text: a deployment's guard or capture spec
        is the same in every request, and each of a burst's requests waits for the ones
        before it here (an hs spec: 15 of its 30 us on the dev CPU). Keyed by the
        msgpack bytes of a spec of JSON types only (they tell apart what validation
        does: 1 from 1.0 and True, NaN from null; a spec holding a tuple or bytes, which
        msgpack would write as a list or bytes, is normalised each time; a numpy array
        of numbers is keyed by its dtype, shape and bytes: an in-process caller's steering
        vector, whose normalisation was most of its request's admission,
        benchmarks/cpu: test_remembered_spec[steer-numpy]), and by the vector registry's
        generation (names may resolve differently)."""
        try:
            text = _KEY.encode(raw) if _plain(raw) else b""
        except OverflowError:  # an int past 64 bits: validation says what is wrong
            text = b""
        key = (text, self.vectors.generation) if 0 < len(text) <= SPEC_CACHE_BYTES else None
        if key is not None:
            with self._lock:
                if (known := self._specs.get(key)) is not None:
                    self._specs.move_to_end(key)
                    return known
        spec = normalise(parse_spec(raw), self.shape, self.vectors)  # may raise: not kept
        known = spec, SizePlan(spec, self.shape), {}, {}
        if key is not None:
            with self._lock:
                self._specs[key] = known
                if len(self._specs) > SPEC_CACHE:
                    self._specs.popitem(last=False)
        return known

    def admit_request(self, request) -> None:
        params = request.sampling_params
        spec = self.wire_specs(params.hooks if params is not None else None)
        keys = spec.vector_keys
        # N API server processes (or data-parallel frontends) feed one worker table: each
        # holds at most its share, so together they never overflow it.
        share = max(self.shape.max_vectors // max(self.api_servers, 1), 1)
        with self._lock:
            new = [k for k in keys if self._refs[k] == 0]
            held = sum(1 for n in self._refs.values() if n > 0)
            if held + len(new) > share:
                raise HookSpecError(
                    f"hooks.steer: this request needs {len(new)} new resident vector(s) and "
                    f"live requests hold {held} of the {share} slots this API server may "
                    f"hold (hook_config.max_vectors {self.shape.max_vectors} over "
                    f"{self.api_servers} server(s)); retry when some finish, or raise it")
            live = sum(self._bytes.values())
            budget = self.shape.max_live_capture_bytes // max(self.api_servers, 1)
            if spec.capture_bytes and live + spec.capture_bytes > budget:
                raise HookSpecError(
                    f"hooks.capture: this request may return {spec.capture_bytes} bytes and "
                    f"live requests may return {live} of the {budget} this API server holds "
                    f"(hook_config.max_live_capture_bytes); retry when some finish")
            if keys:
                self._live[request.request_id] = keys
                self._refs.update(keys)
            if spec.capture_bytes:
                self._bytes[request.request_id] = spec.capture_bytes
            if spec.captures_anything:
                prompt = getattr(request, "prompt_token_ids", None)
                self._finish[request.request_id] = (
                    spec, len(prompt) if prompt else 0,
                    holds_outputs(spec, params, self.hold_bytes))

    def stats(self) -> dict:
        """What this frontend holds now (leak checks: zeros once every request ended)."""
        with self._lock:
            return {"requests_with_vectors": len(self._live),
                    "vectors_held": sum(1 for n in self._refs.values() if n > 0),
                    "requests_capturing": len(self._finish),
                    "live_capture_bytes": sum(self._bytes.values()),
                    "saved_bytes": self.saver.written,
                    "shipped_waiting": self.shipped.waiting()}

    def release_request(self, request_id: str) -> None:
        self.shipped.release(request_id)
        with self._lock:
            self._finish.pop(request_id, None)  # aborted before it finished
            self._bytes.pop(request_id, None)
            keys = self._live.pop(request_id, None)
            if keys:
                self._refs.subtract(keys)
                for k in keys:
                    if self._refs[k] <= 0:
                        del self._refs[k]

    def _capturing(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._finish

    def host_timeline(self) -> list[tuple[str, float, float]]:
        """This frontend's phase calls since the last look (profiling.HostClock), on the
        clock of vLLM's request timestamps (benchmarks/gpu/bench_tpot.py records them)."""
        return self.clock.timeline()

    def rows_arrived(self, request_id: str, payloads):
        # a shipped step is split here, in the frontend's process, off the busy loop's
        return self.shipped.arrived(request_id, payloads)

    def output_slices(self, outputs, chunk_size: int):
        # A capturing request's finish assembles its outputs on AsyncLLM's output
        # handler, and every other output of its message waited for it: in a burst the
        # first requests finish in the message that brings the last ones their first
        # token (benchmarks/cpu/test_bench_delivery.py). They go last, in slices of
        # their own, and the handler lets the others' consumers run in between.
        finishing = self._finish  # read without the lock: membership is atomic
        now, last = [], []
        if finishing:
            for o in outputs:
                slow = o.finish_reason is not None and o.request_id in finishing
                (last if slow else now).append(o)
        if not last or not now:
            return super().output_slices(outputs, chunk_size)
        return super().output_slices(now, chunk_size) + super().output_slices(last, chunk_size)

    def finish_outputs(self, request_id: str, chunks, num_tokens: int = 0) -> HookOutputs | None:
        # Runs in AsyncLLM's output handler, where an exception stops the API server:
        # whatever goes wrong fails this request's hooks only, with the reason.
        with self._lock:
            spec, prompt_len, chunks_held = self._finish.pop(request_id, (None, 0, False))
        if spec is None and not chunks:
            return None  # a request without captures (vLLM asks for every request)
        with self.clock.phase("finish"):
            return self._finished(request_id, chunks, num_tokens, spec, prompt_len,
                                  chunks_held)

    def _finished(self, request_id, chunks, num_tokens, spec, prompt_len,
                  chunks_held) -> HookOutputs:
        try:
            # probes hold their rows, and an engine may hold every chunk, on the worker
            # until the request may finish: the last send must cover its length
            held = num_tokens - 1 if spec is not None and (spec.probe or chunks_held) \
                else None
            chunks = self.shipped.resolve(request_id, chunks)
            out = assemble([c for p in chunks for c in open_chunks(p)],
                           spec.guard if spec is not None else None, prompt_len, held)
        except Exception as e:
            logger.exception("graphtap: assembling request %s's hook outputs", request_id)
            return HookOutputs(error=f"hooks: graphtap could not assemble this request's "
                                     f"outputs ({type(e).__name__}: {e}); please report it")
        out.encoding = spec.encoding if spec else "raw"
        if spec is not None and spec.save_to and not out.error:
            self.saver.save(spec.save_to, request_id, out)
        return out

    def response_hooks(self, hooks) -> dict | None:
        """A finished request's hooks as an OpenAI choice carries them (graphtap.wire)."""
        return None if hooks is None else encode(hooks)


_SCALARS = frozenset((str, int, float, bool, type(None)))
_PLAIN = _SCALARS | {dict, list}
_ARRAY = 1  # the msgpack extension code of a numpy array in a spec's cache key


def _array_ext(obj) -> msgspec.msgpack.Ext:
    """A numpy array in a cache key: its dtype, its shape and its bytes, so it never
    equals a list's or bytes' encoding, nor an array of another dtype or shape."""
    if type(obj) is not np.ndarray:
        raise TypeError(f"no cache key for {type(obj).__name__}")
    head = f"{obj.dtype.str}{obj.shape}".encode()
    return msgspec.msgpack.Ext(_ARRAY, bytes([len(head)]) + head + obj.tobytes())


_KEY = msgspec.msgpack.Encoder(enc_hook=_array_ext)


def _array(v) -> bool:
    """A numpy array of numbers (a vector field's value): keyed by its bytes."""
    return type(v) is np.ndarray and v.dtype.kind in "fiu"


def _plain(x) -> bool:
    """Whether x is made of JSON's types only (exact types: no subclasses), or of numpy
    arrays of numbers where a value may be one (keyed by their bytes). A loop over
    an explicit stack (a recursive generator per container cost more than the cache
    lookup it guards); a long list's element types are gathered in C, so a 4096-float
    steering vector sent as a JSON list costs no Python step per float."""
    stack = [x]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is dict:
            for k, w in v.items():
                if type(k) is not str:
                    return False
                tw = type(w)
                if tw is dict or tw is list:
                    stack.append(w)
                elif tw not in _SCALARS and not _array(w):
                    return False
        elif t is list and len(v) > 16:
            kinds = set(map(type, v))
            if not kinds <= _PLAIN:
                return False
            if dict in kinds or list in kinds:
                stack.extend(w for w in v if type(w) is dict or type(w) is list)
        elif t is list:
            for w in v:
                tw = type(w)
                if tw is dict or tw is list:
                    stack.append(w)
                elif tw not in _SCALARS and not _array(w):
                    return False
        elif t not in _SCALARS:
            return False
    return True
