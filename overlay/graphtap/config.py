"""Engine-level graphtap options (`hook_config=`), fixed for the engine's lifetime."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from graphtap.spec.sites import SiteTable, expand_patterns

DEFAULT_SITES = ["blocks.*.hook_resid_pre", "blocks.*.hook_resid_mid", "blocks.*.hook_resid_post"]


class HookConfig(BaseModel):
    """An engine's `hook_config`: which sites get ops, and every table's size."""

    model_config = ConfigDict(extra="forbid")

    sites: list[str] = Field(default_factory=lambda: list(DEFAULT_SITES))
    """Sites that get an op in the graph. Each costs one small kernel per forward even
    when idle, so production engines name only the sites they use."""
    max_vectors: int = Field(64, ge=1, le=65536)
    """Resident steering-vector table size (distinct vectors of live requests)."""
    max_steers: int = Field(8, ge=1, le=64)
    """Steer entries per request."""
    max_captures: int = Field(8, ge=1, le=64)
    """Capture entries (sites) per request."""
    max_probes: int = Field(4, ge=0, le=64)
    """Probe entries (residual sites) per request; 0: no probe op in the graph."""
    probe_width: int = Field(8, ge=1, le=64)
    """Weight vectors (scores) per probe entry."""
    probe_rows: int = Field(4096, ge=1)
    """Rows of the device probe-score buffer per step (one per position and probed
    site, probe_width float32 scores each); overflow is reported like capture_rows."""
    probe_ring: int = Field(256, ge=16, le=65536)
    """Generated positions' probe scores per request slot and entry in the device ring
    (engine/ring.py): a decode step writes them there, inside the graph,
    instead of routing rows home every step. The host reads a request's ring when it is
    half full or the request may finish; a step that runs more than a quarter of it for
    one request routes rows instead."""
    max_spans: int = Field(8, ge=1, le=64)
    """Key spans per attention_mass entry."""
    mass_rows: int = Field(1024, ge=1)
    """Rows of the device attention-mass buffer per step (one per query position and
    head, max_spans float32 masses each); allocated when a hook_pattern site is
    configured; overflow is reported like capture_rows."""
    save_root: str | None = None
    """Directory under which requests may ask for `save_to` files (none: refused), so a
    request can never make the server write anywhere else: `save_to` is a relative
    folder of plain names, walked without following symlinks; files are written under a
    temporary name and renamed. A failed save fails that request's save only
    (`save_error` in its outputs), never the server."""
    save_quota_bytes: int = Field(16 * 2**30, ge=0)
    """Bytes of `save_to` files each API server process may write in its lifetime; past
    it, saves fail with an error naming this option."""
    sink_dir: str | None = None
    """The engine's bulk sink (courier/sink.py): captures a request marks `"sink": true`
    are appended here, per site, to sharded safetensors files with an index.json, by a
    writer thread in the worker, instead of coming back with the request (none: such
    captures are refused). The operator picks the folder; a request only opts in."""
    sink_shard_rows: int = Field(65536, ge=1)
    """Rows per sink shard file (a partial shard is written once no sink request is left)."""
    sink_max_queued_bytes: int = Field(256 * 2**20, ge=2**20)
    """Bytes of rows queued for the sink's writer; past it the engine waits for the
    writer (backpressure: the engine slows, no row is dropped)."""
    capture_rows: int | None = Field(None, ge=1)
    """Rows of the device capture buffer, per step (each row: one position at one site,
    the widest configured site's values in the model's dtype). Default: the largest step
    (max_num_batched_tokens) times the sites one request may capture (max_captures, at
    most the configured q/k/v/z and residual sites), so a step whose every token is
    captured at every such site fits (a Q/K capture of an 8192-token prefill). Part of
    the memory vLLM profiles; a step that would need more fails the captures of the
    requests in its batch that capture, with an error, instead of dropping rows."""

    hold_outputs_bytes: int = Field(0, ge=0)
    """Hold a capturing request's step outputs on the worker until a step that may
    finish it, at most this many bytes per worker (the host buffers held chunks keep
    alive, a step's copy counted by every request holding part of it; past it they go
    home at once); 0:
    every step's outputs travel with that step's tokens (courier/held_chunks.py). Held,
    a prompt's rows no longer travel with its first token; the frontend returns them at
    the finish either way. Requests with stop strings or repetition detection (any step
    may finish them) are never held."""

    split_in_frontend: bool = True
    """Whether a large capture step whose split may wait (no guard, nothing held, no
    sink) travels to the frontend whole, rows and labels, and is split there
    (courier/shipped.py), instead of on the engine core's output thread beside the busy
    loop, whose time it took (twice the split's own: GIL hand-overs). Only with one API
    server (with several, a step's requests may belong to different frontends) and a
    worker in the engine core's process (a GPU engine without tensor parallelism; one
    of its own splits a step as it sends it)."""

    pinned_warm_bytes: int = Field(128 * 2**20, ge=0)
    """Pinned host memory each GPU worker allocates and frees at start (and again after
    CUDA-graph capture, which empties torch's pool), in the
    power-of-two blocks its steps' copies home will ask torch's pinned pool for (four of
    each size, smallest first, up to the capture buffer's size or as far as this goes:
    the default reaches 16 MiB blocks, a prefill step's k rows of 8 x 256 tokens at 4
    layers; courier/pinned.py), so that a capture step does not allocate pinned memory
    on the engine's busy loop, a stall of milliseconds for every request in the batch.
    0: none (the pool grows as steps need it)."""

    pattern_rows: int = Field(256, ge=1)
    """Rows of the device attention-pattern buffer, per step (each row: one query position
    of one head, max_model_len floats). Allocated only when a hook_pattern site is
    configured; overflow is reported like capture_rows."""

    max_response_rows: int = Field(65536, ge=1)
    """Rows one request may get back (positions x sites; patterns: query positions x
    heads), bounded at admission from its spec, prompt length and max_tokens. A
    Llama-3-8B residual row is 8 KiB in bf16: the default bounds a response at 512 MiB."""
    max_response_bytes: int = Field(256 * 2**20, ge=1)
    """Bytes of captures one request may get back (rows x row width x element size;
    patterns: each query row holds position + 1 keys), bounded at admission like
    max_response_rows: a request's rows gather in host memory until it finishes."""
    max_live_capture_bytes: int = Field(2 * 2**30, ge=1)
    """Bytes of captures all live requests may get back together (split evenly over the
    API server processes); a request past it is refused at admission, retry later."""
    max_request_bytes: int = Field(16 * 2**20, ge=1024)
    """The OpenAI server refuses a larger request body with a 413 before reading it."""
    vectors_dir: str | None = None
    """Every safetensors file here is loaded into the server's named vectors at start."""
    max_registered_vectors: int = Field(256, ge=1, le=65536)
    """Named vectors the server may hold (registered or loaded from vectors_dir)."""

    def site_table(self, num_layers: int) -> SiteTable:
        return SiteTable(expand_patterns(self.sites, num_layers))

    def capture_rows_for(self, sites: SiteTable, max_tokens: int) -> int:
        """capture_rows, or its default for an engine whose steps hold max_tokens."""
        if self.capture_rows is not None:
            return self.capture_rows
        row_sites = sum(s.capture_family == "capture" for s in sites.sites)
        return max(1, max_tokens * min(self.max_captures, row_sites))


def load_hook_config(raw: dict | None) -> HookConfig:
    try:
        return HookConfig.model_validate(raw or {})
    except Exception as e:  # pydantic's message names the field
        raise ValueError(f"hook_config: {e}") from None
