"""Normalisation of what is scored on the device (probes, attention mass) and of the
guard that reads those scores: typed entries, each refusal naming its field."""
from __future__ import annotations

import numpy as np

from graphtap.spec.entries import GuardEntry, MassEntry, ProbeEntry, Span
from graphtap.spec.registry import VectorRegistry
from graphtap.spec.schema import HookSpec, Probe, short
from graphtap.spec.shape import (ModelShape, check_float32, hidden_vector, rule_of, site_of,
                                 vector_key)


def _registered_probe(p: Probe, i: int, vectors: VectorRegistry | None):
    """(weight rows, bias, activation) of `"weights": name`, the entry's own bias and
    activation taking precedence."""
    named = vectors.probe(p.weights) if vectors is not None else None
    if named is None:
        raise ValueError(f"hooks.probe[{i}].weights: no registered probe named "
                         f"{short(p.weights)} (GET /v1/graphtap/vectors lists them)")
    if p.bias is not None and len(p.bias) != len(named.rows):
        raise ValueError(f"hooks.probe[{i}].bias: {len(p.bias)} values for the "
                         f"{len(named.rows)} rows of probe {short(p.weights)}")
    return (tuple(r.data for r in named.rows), p.bias or named.bias,
            p.activation or named.activation)


def _probe_weights(p: Probe, i: int, shape: ModelShape,
                   vectors: VectorRegistry | None) -> tuple[bytes, ...]:
    return tuple(hidden_vector(w, f"hooks.probe[{i}].weights[{j}]", shape, vectors)
                 for j, w in enumerate(p.weights))


def _once(site, seen: set, field: str, what: str) -> None:
    """A request names each site once per family: the rows of one entry are one group."""
    if site in seen:
        raise ValueError(f"{field}.site: {site.name} appears twice; {what}")
    seen.add(site)


def probes(spec: HookSpec, shape: ModelShape,
            vectors: VectorRegistry | None) -> tuple[ProbeEntry, ...]:
    if len(spec.probe) > shape.max_probes:
        raise ValueError(f"hooks.probe: {len(spec.probe)} probe sites, more than the engine's "
                         f"{shape.max_probes} per request (hook_config.max_probes)")
    probes, seen = [], set()
    for i, p in enumerate(spec.probe):
        site = site_of(p.site, f"hooks.probe[{i}]", shape)
        if not site.is_residual:
            raise ValueError(f"hooks.probe[{i}].site: probes read the residual stream "
                             f"(hook_resid_pre|mid|post), not {site.name}")
        _once(site, seen, f"hooks.probe[{i}]", "put every weight vector of that site in one "
              "entry")
        for b in p.bias or ():
            check_float32(b, f"hooks.probe[{i}].bias")
        if not isinstance(p.weights, str) and len(p.weights) > shape.probe_width:
            raise ValueError(f"hooks.probe[{i}].weights: {len(p.weights)} vectors, more than "
                             f"the engine's {shape.probe_width} per site "
                             f"(hook_config.probe_width)")
        if isinstance(p.weights, str):
            data, bias, activation = _registered_probe(p, i, vectors)
        else:
            data, bias, activation = _probe_weights(p, i, shape, vectors), p.bias, p.activation
        if len(data) > shape.probe_width:
            raise ValueError(f"hooks.probe[{i}].weights: {len(data)} vectors, more than "
                             f"the engine's {shape.probe_width} per site "
                             f"(hook_config.probe_width)")
        probes.append(ProbeEntry(
            site.layer, site.kind, f"probe:{site.name}", data,
            tuple(vector_key(d) for d in data),
            tuple(float(b) for b in (bias or [0.0] * len(data))),
            activation == "sigmoid",
            rule_of(p.positions, f"hooks.probe[{i}]", shape.max_model_len)))
    return tuple(probes)


def masses(spec: HookSpec, shape: ModelShape) -> tuple[MassEntry, ...]:
    if len(spec.attention_mass) > shape.max_captures:
        raise ValueError(f"hooks.attention_mass: {len(spec.attention_mass)} sites, more than "
                         f"the engine's {shape.max_captures} per request "
                         f"(hook_config.max_captures)")
    out, seen = [], set()
    for i, m in enumerate(spec.attention_mass):
        field = f"hooks.attention_mass[{i}]"
        site = site_of(m.site, field, shape)
        if site.capture_family != "pattern":
            raise ValueError(f"{field}.site: attention mass is read at "
                             f"blocks.<layer>.attn.hook_pattern sites, not {site.name}")
        _once(site, seen, field, "put its spans and heads in one entry")
        if len(m.spans) > shape.max_spans:
            raise ValueError(f"{field}.spans: {len(m.spans)} spans, more than the engine's "
                             f"{shape.max_spans} (hook_config.max_spans)")
        spans = []
        for j, span in enumerate(m.spans):
            if span.start >= shape.max_model_len:
                raise ValueError(f"{field}.spans[{j}].start: {span.start} is beyond "
                                 f"max_model_len {shape.max_model_len}")
            spans.append(Span(span.start, min(span.end, shape.max_model_len)))
        bad = [h for h in m.heads or () if not 0 <= h < shape.num_heads]
        if bad:
            raise ValueError(f"{field}.heads: head {bad[0]} is out of range: {site.name} has "
                             f"{shape.num_heads} heads (0..{shape.num_heads - 1})")
        heads = tuple(sorted(set(m.heads))) if m.heads else tuple(range(shape.num_heads))
        out.append(MassEntry(site.layer, f"mass:{site.name}", heads, tuple(spans),
                             rule_of(m.positions, field, shape.max_model_len)))
    return tuple(out)


def guard(spec: HookSpec, masses: tuple[MassEntry, ...], probes: tuple[ProbeEntry, ...],
           shape: ModelShape) -> GuardEntry | None:
    g = spec.guard
    if g is None:
        return None
    check_float32(g.threshold, "hooks.guard.threshold")
    want = None
    if g.site is not None:
        want = site_of(g.site, "hooks.guard", shape).name
    if g.kind == "attention_focus":
        chosen = [m for m in masses if want is None or m.name == f"mass:{want}"]
        if not chosen:
            raise ValueError("hooks.guard: 'attention_focus' reads the request's "
                             "attention_mass entries" + (f" at {want}" if want else "") +
                             "; there are none")
        for m in chosen:
            if len(m.spans) < 2 or m.positions not in ("last_prompt", "prompt", "all"):
                raise ValueError(f"hooks.guard: {m.name} needs two spans (instruction, data) "
                                 f"and positions covering the last prompt token "
                                 f"('last_prompt')")
        return GuardEntry(g.kind, g.threshold, g.action == "stop",
                          tuple(m.name for m in chosen))
    chosen = [p for p in probes if want is None or p.name == f"probe:{want}"][:1]
    if not chosen:
        raise ValueError("hooks.guard: 'probe' reads the request's probe" +
                         (f" at {want}" if want else "") + "; there is none")
    (p,) = chosen
    if g.column >= len(p.vectors):
        raise ValueError(f"hooks.guard.column: {g.column}, but {p.name} has "
                         f"{len(p.vectors)} scores")
    if p.positions not in ("all", "generated"):
        raise ValueError(f"hooks.guard: {p.name} must score generated positions "
                         f"('generated' or 'all') for a probe guard")
    return GuardEntry(g.kind, g.threshold, g.action == "stop", (p.name,), g.column)
