"""What a request gets back in `RequestOutput.hooks` (and the client, from a response).
Importable without torch: the client holds numpy arrays in it where torch is absent."""
from __future__ import annotations

from typing import Any


class HookOutputs(dict):
    """site name -> tensor with one row per captured position, rows in position order.

    `positions[site]` holds those positions. Generated positions cover tokens that ran
    through the model: the last sampled token never does, so it has no row. `error` is
    set (and the dict left empty) when the engine could not keep every row, for example
    when a step needed more rows than hook_config.capture_rows: rows are never dropped
    silently. With `save_to`, `saved_to` names the file written (relative to the
    server's save_root), or `save_error` says why none was. With a guard, `guard` holds
    its verdict: kind, threshold, action, score, position, flagged (a stopped request
    finished with finish_reason "guard").
    """

    def __init__(self, tensors=None, positions=None, error: str | None = None,
                 encoding: str = "raw", saved_to: str | None = None,
                 save_error: str | None = None, guard: dict | None = None):
        super().__init__(tensors or {})
        self.positions: dict[str, Any] = dict(positions or {})
        self.error = error
        self.encoding = encoding  # how the OpenAI server writes it (graphtap.wire)
        self.saved_to = saved_to  # the save_to file, relative to save_root, once written
        self.save_error = save_error  # why it was not (the captures are still here)
        self.guard = guard  # a guard's verdict, when the request had one

    def __repr__(self) -> str:
        if self.error:
            return f"HookOutputs(error={self.error!r})"
        return "HookOutputs(" + ", ".join(f"{k}: {tuple(v.shape)}" for k, v in self.items()) + ")"
