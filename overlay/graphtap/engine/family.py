"""The shape every hook family has: the manager holds a list of families and loops over
it (engine/manager.py); no family imports another. A new family (probe scores, attention
focus, ...) is one file under engine/families/ plus its op."""
from __future__ import annotations

from typing import Any, Protocol

from graphtap.spec.entries import NormalisedSpec


class HookFamily(Protocol):
    """What the manager asks of each family, in the order the runner calls it."""

    name: str

    def add_request(self, slot: int, req_id: str, prompt_len: int,
                    spec: NormalisedSpec) -> None:
        """Stage the slot's whole row of this family's entries (every field: a reused
        slot inherits nothing), from the spec's entries for this family (maybe none)."""

    def remove_request(self, req_id: str) -> None: ...

    def apply_staged_writes(self) -> None:
        """Write what add_request staged beyond the slot block (the engine writes that)."""

    def bind_kv_caches(self, layers: list) -> None:
        """vLLM's AttentionLayerInfo per attention layer, once its cache exists."""

    def plan(self, input_batch) -> Any:
        """Host side, every step: what this family does in the step (falsy: nothing).
        Cheap, and never syncs with the device."""

    def route(self, input_batch, router, plan) -> None:
        """Device side, after the router mapped this step's tokens to slots."""

    def deactivate(self) -> None:
        """Nothing of this family acts in the next forward (dummy runs, capture)."""

    def snapshot(self):
        """After the forward: this step's rows for the courier (a courier StepRows
        consumer such as CaptureStep), or None."""

    def stats(self) -> dict:
        """Counts of what it holds (requests, slots, vectors), for leak checks."""


class FamilyBase:
    """No-op defaults for the optional parts of the protocol."""

    def apply_staged_writes(self) -> None:
        pass

    def bind_kv_caches(self, layers: list) -> None:
        pass

    def route(self, input_batch, router, plan) -> None:
        pass

    def deactivate(self) -> None:
        pass

    def snapshot(self):
        return None

    def stats(self) -> dict:
        """What the family holds now (leak checks: all zero once every request ended)."""
        return {}
