"""graphtap's graph ops: torch custom ops whose behaviour is data in one engine's tables,
each with a torch reference (CPU, and the spec of truth in tests) and a Triton kernel
(GPU) side by side; the implementation is picked once per engine (backend.py). Importing
this package registers the ops, which must happen before the first trace."""
from graphtap.ops import capture, mass, pattern, probe, steer  # noqa: F401  registers the custom ops
