"""The courier: step snapshots of labelled device rows go home on vLLM's output copy
stream, are split per request once there, and become a finished request's
`RequestOutput.hooks` in the frontend (overflow as a typed error, `save_to` files)."""
from graphtap.courier.assemble import assemble
from graphtap.courier.chunks import Overflow, OverflowKind, RequestErrors
from graphtap.courier.held_chunks import holds_outputs
from graphtap.courier.patterns import PatternFormat, PatternStep
from graphtap.courier.payload import open_chunks, open_payload, seal
from graphtap.courier.pack import columns
from graphtap.courier.rows import CaptureStep, RowFormat
from graphtap.courier.save import Saver
from graphtap.courier.shipped import ShippedRows
from graphtap.courier.snapshot import LabelledStep, StepRows, StepSnapshots

__all__ = ["CaptureStep", "LabelledStep", "Overflow", "OverflowKind", "PatternFormat",
           "PatternStep", "RequestErrors", "RowFormat", "Saver", "ShippedRows", "StepRows",
           "StepSnapshots", "assemble",
           "columns", "holds_outputs", "open_chunks", "open_payload", "seal"]
