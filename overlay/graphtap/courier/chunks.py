"""The courier's chunk schema: what one step's split hands each request (name -> CPU
tensor; sealed for the hop to the frontend by payload.py), and the typed overflow error
that replaces a request's rows when they could not all be kept."""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

OVERFLOW = "graphtap:overflow"  # key of an overflow report in a chunk
ERROR = "graphtap:error"  # key of a worker's refusal of a request (UTF-8 bytes)
HELD = "graphtap:held"  # a held family's chunk: [positions computed when it was sent]
FINISH = "hooks:finish"  # sealed as HookPayload.finish (patch 0007): the scheduler finishes it


def error_tensor(message: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(message.encode()), dtype=torch.uint8)


def error_message(t: torch.Tensor) -> str:
    return bytes(t.numpy().tobytes()).decode(errors="replace")


class RequestErrors:
    """A step part holding the worker's refusals of requests, each delivered as that
    request's error (the worker never raises over one request: the engine would die)."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors

    def to_cpu_nonblocking(self) -> None:
        pass

    def release_device(self) -> None:
        pass

    def per_request(self) -> dict[str, dict[str, torch.Tensor]]:
        return {req: {ERROR: error_tensor(m)} for req, m in self.errors.items()}


def positions_key(name: str) -> str:
    """Key of a site's positions (one per row, or per query row for patterns)."""
    return f"{name}@positions"


def ragged_key(name: str) -> str:
    """Key of a pattern site's values: flat ragged rows (position, head, keys 0..pos)."""
    return f"{name}@ragged"


def ragged_name(key: str) -> str | None:
    """The pattern site whose ragged values `key` holds, or None."""
    return key[: -len("@ragged")] if key.endswith("@ragged") else None


def is_data_key(key: str) -> bool:
    """Whether `key` holds a site's rows (not positions, ragged values or an overflow)."""
    return "@" not in key and not key.startswith(("graphtap:", "hooks:"))


class OverflowKind(IntEnum):
    """Which bound a step's rows exceeded."""

    CAPTURE_ROWS = 0  # a step needed more rows than hook_config.capture_rows
    PATTERN_ROWS = 1  # a step needed more rows than hook_config.pattern_rows
    HOST_BOUND = 2  # the host's bound on a step's rows was short: a graphtap bug
    PROBE_ROWS = 3  # a step needed more rows than hook_config.probe_rows
    MASS_ROWS = 4  # a step needed more rows than hook_config.mass_rows


@dataclass(frozen=True)
class Overflow:
    """Why a request's captures were withheld rather than returned incomplete."""

    kind: OverflowKind
    wanted: int
    capacity: int

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([self.wanted, self.capacity, int(self.kind)], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Overflow":
        wanted, capacity, kind = t[:3].tolist()
        return cls(OverflowKind(kind), wanted, capacity)

    def message(self) -> str:
        if self.kind == OverflowKind.HOST_BOUND:
            return (f"hooks.capture: graphtap bug: this request wanted {self.wanted} rows of "
                    f"a step whose copy home the host bounded at {self.capacity}; its "
                    f"captures were withheld rather than returned incomplete (please "
                    f"report it)")
        what, option = {OverflowKind.PATTERN_ROWS: ("attention-pattern rows", "pattern_rows"),
                        OverflowKind.PROBE_ROWS: ("probe rows", "probe_rows"),
                        OverflowKind.MASS_ROWS: ("attention-mass rows", "mass_rows")}.get(
                            self.kind, ("capture rows", "capture_rows"))
        return (f"hooks.capture: this request needed {self.wanted} {what} in one step, "
                f"and the step's buffer holds {self.capacity} for all its requests "
                f"(hook_config.{option}); its captures were withheld rather than returned "
                f"incomplete")
