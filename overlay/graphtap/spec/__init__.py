"""The spec side: what a request may ask for, checked against the engine and normalised
into typed, data-only entries per hook family (imports nothing of the engine)."""
from graphtap.spec.entries import (EMPTY, CaptureEntry, NormalisedSpec, PatternEntry, Span,
                                   SteerEntry, WireSpecs)
from graphtap.spec.normalise import ModelShape, normalise, steer_bounds, steer_gain
from graphtap.spec.registry import VectorRegistry
from graphtap.spec.salt import combined_salt, steering_salt
from graphtap.spec.schema import Capture, HookSpec, Steer, parse_spec
from graphtap.spec.sites import Site, SiteTable, expand_patterns, parse_site

__all__ = ["EMPTY", "Capture", "CaptureEntry", "HookSpec", "ModelShape", "NormalisedSpec",
           "PatternEntry", "Site", "SiteTable", "Span", "Steer", "SteerEntry", "combined_salt",
           "expand_patterns", "normalise", "parse_site", "parse_spec", "steer_bounds", "steer_gain",
           "steering_salt", "VectorRegistry", "WireSpecs"]
