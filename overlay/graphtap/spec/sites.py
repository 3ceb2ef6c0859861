"""Hook sites: TransformerLens names <-> (layer, kind) <-> dense site ids, and which hook
family takes a site of each kind (the one place that decides it).

A site id is what the graph-baked ops carry (an int constant per op call); names are what
users write. Residual kinds are the three slots in vLLM's decoder layers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from graphtap.spec.schema import short

RESID_KINDS = ("resid_pre", "resid_mid", "resid_post")
ATTN_KINDS = ("attn_q", "attn_k", "attn_v", "attn_z", "attn_pattern")
KINDS = RESID_KINDS + ATTN_KINDS
PATTERN = "attn_pattern"
KV_HEAD_KINDS = ("attn_k", "attn_v")  # heads counted in KV heads (GQA), as TransformerLens
# One spelling per site: ASCII digits without leading zeros, nothing before or after
# (fullmatch: "$" would let a trailing newline through, and \d Unicode digits).
_NAME = re.compile(r"blocks\.(0|[1-9][0-9]*|\*)\.(hook_resid_pre|hook_resid_mid|hook_resid_post|"
                   r"attn\.hook_q|attn\.hook_k|attn\.hook_v|attn\.hook_z|attn\.hook_pattern)")


def _kind(tail: str) -> str:
    return tail.replace("attn.hook_", "attn_").replace("hook_", "")


@dataclass(frozen=True)
class Site:
    """One hook site: a layer and a kind (resid_pre, attn_k, ...)."""

    layer: int
    kind: str

    @property
    def name(self) -> str:
        if self.kind.startswith("attn_"):
            return f"blocks.{self.layer}.attn.hook_{self.kind[5:]}"
        return f"blocks.{self.layer}.hook_{self.kind}"

    @property
    def is_residual(self) -> bool:
        return self.kind in RESID_KINDS

    @property
    def capture_family(self) -> str:
        """The family that captures this site: attention patterns are computed rows of
        their own (family "pattern"); every other site's rows are copied ("capture")."""
        return "pattern" if self.kind == PATTERN else "capture"


def parse_site(name: str, num_layers: int) -> Site:
    """'blocks.3.hook_resid_post' -> Site(3, 'resid_post'); ValueError with the reason."""
    m = _NAME.fullmatch(name) if isinstance(name, str) else None
    if not m or m.group(1) == "*":
        raise ValueError(f"unknown site {short(name)}: expected blocks.<layer>.hook_resid_pre|"
                         f"hook_resid_mid|hook_resid_post or blocks.<layer>.attn.hook_q|"
                         f"hook_k|hook_v|hook_z|hook_pattern")
    layer = int(m.group(1))
    if layer >= num_layers:
        raise ValueError(f"layer {layer} is out of range: the model has {num_layers} layers "
                         f"(0..{num_layers - 1})")
    return Site(layer, _kind(m.group(2)))


def expand_patterns(patterns: list[str], num_layers: int) -> list[Site]:
    """Configured site patterns ('blocks.*.hook_resid_post' allowed) -> sorted unique sites."""
    sites: set[Site] = set()
    for pattern in patterns:
        m = _NAME.fullmatch(pattern) if isinstance(pattern, str) else None
        if not m:
            raise ValueError(f"hook_config.sites: unknown site pattern {short(pattern)}")
        layers = range(num_layers) if m.group(1) == "*" else [int(m.group(1))]
        for layer in layers:
            sites.add(parse_site(f"blocks.{layer}.{m.group(2)}", num_layers))
    return sorted(sites, key=lambda s: (s.layer, KINDS.index(s.kind)))


class SiteTable:
    """The sites an engine was built with; ids are dense in [0, len)."""

    def __init__(self, sites: list[Site]):
        self.sites = list(sites)
        self.ids = {s: i for i, s in enumerate(self.sites)}
        self._by_slot = {(s.layer, s.kind): i for s, i in self.ids.items()}

    def __len__(self) -> int:
        return len(self.sites)

    def id_for_slot(self, layer: int, kind: str) -> int | None:
        """Looked up at trace time: the op for a slot exists only if its site is configured."""
        return self._by_slot.get((layer, kind))

    def id_of(self, layer: int, kind: str) -> int:
        """A normalised entry's site id; the frontend checked that it is configured, so a
        miss means the two sides disagree: a loud error."""
        sid = self._by_slot.get((layer, kind))
        if sid is None:
            raise RuntimeError(f"graphtap: site {Site(layer, kind).name} is not configured")
        return sid

    def names(self) -> dict[int, str]:
        return {i: s.name for i, s in enumerate(self.sites)}
