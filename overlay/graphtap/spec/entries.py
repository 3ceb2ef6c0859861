"""What the engine receives: a request's spec normalised into typed entries, one list per
hook family, data only.

The frontend builds a `NormalisedSpec`; it travels to the worker inside
`SamplingParams.hooks` as its msgpack bytes (`to_wire`: data only, no pickles, vectors
as float32 bytes) and is typed again there (`from_wire`). The family of a capture is
chosen by its site's kind (`Site.capture_family`), once, in `normalise`.
"""
from __future__ import annotations

from typing import Union

import msgspec

FORMAT = 2


class Span(msgspec.Struct, frozen=True):
    """Positions start <= p < end."""

    start: int
    end: int


# "all" | "prompt" | "generated" | "last_prompt", a span, or sorted unique positions
PositionRule = Union[str, Span, tuple[int, ...]]


class ConditionEntry(msgspec.Struct, frozen=True):
    """A steer's gate: score = <h, v/|v|> (unit) or act(<h, v> + bias) of one residual
    site at the last prompt token; on when score > threshold (< with `below`)."""

    layer: int
    kind: str
    vector: bytes  # float32, native byte order
    key: str
    threshold: float
    unit: bool
    bias: float = 0.0
    sigmoid: bool = False
    below: bool = False


class SteerEntry(msgspec.Struct, frozen=True):
    """delta = a*v + (clamp(<h, v_hat>, lo, hi) - <h, v_hat>) * v_hat + g * (v * h) at
    the positions (h: the row at the site; g scales the elements v masks: head scaling)."""

    layer: int
    kind: str
    vector: bytes  # float32, native byte order
    key: str  # content hash of vector: the resident table's key
    a: float
    lo: float
    hi: float
    positions: PositionRule
    g: float = 0.0
    condition: ConditionEntry | None = None  # None: always on


class CaptureEntry(msgspec.Struct, frozen=True):
    """Rows of one site (residual, q, k, v or z) copied out at the positions."""

    layer: int
    kind: str
    name: str
    dtype: str  # "model" or "float32"
    heads: tuple[int, ...] | None  # attention sites: chosen heads, ascending; None: all
    positions: PositionRule
    sink: bool = False  # rows go to the engine's bulk sink, not back with the request


class PatternEntry(msgspec.Struct, frozen=True):
    """Attention probabilities of the chosen query heads at the query positions."""

    layer: int
    name: str
    dtype: str
    heads: tuple[int, ...]  # query heads, ascending
    positions: PositionRule


class ProbeEntry(msgspec.Struct, frozen=True):
    """Scores act(<h, w_i> + b_i) of one residual site at the positions, on the device."""

    layer: int
    kind: str
    name: str  # the output's key: "probe:<site>"
    vectors: tuple[bytes, ...]  # float32 weight vectors, native byte order
    keys: tuple[str, ...]  # their content hashes (resident rows shared with steering)
    bias: tuple[float, ...]
    sigmoid: bool
    positions: PositionRule

    @property
    def dtype(self) -> str:  # scores are float32 (the row families' entry interface)
        return "float32"


class MassEntry(msgspec.Struct, frozen=True):
    """Attention mass of the chosen query heads on key spans at the query positions."""

    layer: int
    name: str  # the output's key: "mass:<site>"
    heads: tuple[int, ...]  # query heads, ascending
    spans: tuple[Span, ...]
    positions: PositionRule

    @property
    def dtype(self) -> str:
        return "float32"


class GuardEntry(msgspec.Struct, frozen=True):
    """A guard over the request's own outputs: `sources` are their keys ("mass:<site>"
    or one "probe:<site>"), evaluated per step on the host as rows arrive."""

    kind: str  # "attention_focus" | "probe"
    threshold: float
    stop: bool
    sources: tuple[str, ...]
    column: int = 0


class NormalisedSpec(msgspec.Struct, frozen=True):
    """A request's entries per family, and where its captures are saved."""

    format: int = FORMAT
    steer: tuple[SteerEntry, ...] = ()
    capture: tuple[CaptureEntry, ...] = ()
    pattern: tuple[PatternEntry, ...] = ()
    probe: tuple[ProbeEntry, ...] = ()
    mass: tuple[MassEntry, ...] = ()
    guard: GuardEntry | None = None
    save_to: str | None = None
    encoding: str = "raw"  # of the captures in an HTTP response: "raw" or "safetensors"
    capture_bytes: int = 0  # at most this many bytes of rows come back (set at admission)

    @property
    def captures_anything(self) -> bool:
        return bool(self.capture or self.pattern or self.probe or self.mass)

    @property
    def vector_keys(self) -> set[str]:
        """The resident vectors the request holds while it lives (steering and probes)."""
        return {s.key for s in self.steer} | {k for p in self.probe for k in p.keys} | \
            {s.condition.key for s in self.steer if s.condition is not None}

    def to_wire(self) -> dict:
        """`SamplingParams.hooks` as it travels: one bytes value, so the engine core's
        input thread, which decodes each request while the step it runs beside waits
        for the GIL, copies a spec rather than building a tree of Python objects per
        request (benchmarks/cpu/test_bench_admission.py::test_engine_core_decode)."""
        return {WIRE: msgspec.msgpack.encode(self)}

    @classmethod
    def from_wire(cls, raw) -> "NormalisedSpec":
        """The worker's view of `SamplingParams.hooks` (None or empty: no entries)."""
        if not raw:
            return EMPTY
        if isinstance(raw, cls):
            return raw
        packed = raw.get(WIRE) if isinstance(raw, dict) and len(raw) == 1 else None
        if isinstance(packed, (bytes, bytearray, memoryview)):
            return _DECODE(packed)
        # only graphtap's frontend writes hooks in the form the engine reads: anything
        # else skipped its validation and the spec cache's checks, so it is not guessed at
        raise ValueError("hooks: the engine reads only a spec the graphtap frontend "
                         "normalised (NormalisedSpec.to_wire); this one was not")


EMPTY = NormalisedSpec()
WIRE = "graphtap"  # the key of a spec's msgpack bytes in SamplingParams.hooks
_DECODE = msgspec.msgpack.Decoder(NormalisedSpec).decode


class WireSpecs:
    """NormalisedSpec.from_wire remembered per wire bytes, for one owner (an engine's
    hook manager, a frontend): a burst's requests carry one spec, and decoding it again
    cost each of them a few us, on the engine core's busy loop before the step that
    admits them and in the frontend's admission (benchmarks/cpu: test_admission_step,
    test_admit_request). The bytes are the key: equal bytes decode to equal specs, which are
    frozen, so one is shared."""

    def __init__(self, size: int = 64, max_bytes: int = 16 << 10) -> None:
        self._known: dict[bytes, NormalisedSpec] = {}
        self._size, self._max_bytes = size, max_bytes

    def __call__(self, raw) -> NormalisedSpec:
        packed = raw.get(WIRE) if type(raw) is dict and len(raw) == 1 else None
        if type(packed) is not bytes or len(packed) > self._max_bytes:
            return NormalisedSpec.from_wire(raw)
        spec = self._known.get(packed)
        if spec is None:
            spec = self._known[packed] = _DECODE(packed)
            if len(self._known) > self._size:
                self._known.pop(next(iter(self._known)), None)  # the oldest
        return spec
