"""A client for graphtap behind `vllm serve`, importable without vLLM and without torch.

    from graphtap import Client

    client = Client("http://127.0.0.1:8000", api_key=None)
    out = client.complete("The capital of France is", max_tokens=8, temperature=0,
                          hooks={"capture": [{"site": "blocks.12.hook_resid_post",
                                              "positions": "last_prompt"}]})
    out.text, out.hooks["blocks.12.hook_resid_post"], out.hooks.positions[...]

Captures come back as numpy arrays (bfloat16 upcast to float32, exactly), or as torch
tensors in their own dtype when torch is importable (`as_torch`).
"""
from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from graphtap.outputs import HookOutputs
from graphtap.wire import decode


class GraphtapError(RuntimeError):
    """An error answer of the server: its HTTP status, message and the field it names."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.param = status, message, param


@dataclass
class Choice:
    """One choice of a completion: its text, tokens and hook outputs."""

    text: str
    finish_reason: str | None
    token_ids: list[int] | None
    hooks: HookOutputs | None


@dataclass
class Completion:
    """A finished completion; `text` and `hooks` are its first choice's."""

    choices: list[Choice]
    response: dict = field(repr=False)

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def hooks(self) -> HookOutputs | None:
        return self.choices[0].hooks


PACKED_FIELDS = ("vector", "weights")  # vectors: float32 bytes, not JSON float lists


def pack(values) -> str:
    """A vector as the spec's packed form: base64 of little-endian float32."""
    if hasattr(values, "detach"):  # torch
        values = values.detach().float().cpu().numpy()
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()


def _jsonable(value: Any, key: str | None = None) -> Any:
    """A spec with numpy arrays or torch tensors as vectors, as JSON data: arrays under
    "vector" and the rows of "weights" travel packed ({"b64": ...}: a 4096-float list is
    ~3x the bytes and ~0.3 ms of the server's element-by-element validation)."""
    if key in PACKED_FIELDS and hasattr(value, "tolist") and not isinstance(value, str):
        if getattr(value, "ndim", 0) == 1 and key == "vector":
            return {"b64": pack(value)}
        if getattr(value, "ndim", 0) == 2 and key == "weights":
            return [{"b64": pack(row)} for row in value]
    if key == "weights" and isinstance(value, (list, tuple)):
        return [{"b64": pack(w)} if getattr(w, "ndim", 0) == 1 else _jsonable(w)
                for w in value]
    if isinstance(value, dict):
        return {k: _jsonable(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays, torch tensors, numpy scalars
        return value.tolist()
    return value


class Stream:
    """Iterate for text deltas; once done, `text`, `finish_reason` and `hooks` hold the
    result (the hooks arrive on the final chunk)."""

    def __init__(self, lines: Iterator[str], chat: bool, as_torch: bool | None, close):
        self._lines, self._chat, self._as_torch, self._close = lines, chat, as_torch, close
        self.text, self.finish_reason, self.hooks = "", None, None

    def __iter__(self) -> Iterator[str]:
        try:
            for line in self._lines:
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data.strip() == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    raise GraphtapError(err.get("code", 500), err.get("message", ""),
                                        err.get("param"))
                for choice in chunk.get("choices", []):
                    delta = (choice.get("delta") or {}).get("content") if self._chat \
                        else choice.get("text")
                    if delta:
                        self.text += delta
                        yield delta
                    if choice.get("finish_reason"):
                        self.finish_reason = choice["finish_reason"]
                    if choice.get("hooks") is not None:
                        self.hooks = decode(choice["hooks"], self._as_torch)
        finally:
            self._close()


class Client:
    """graphtap's OpenAI-compatible server: completions, chat, streams, named vectors."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 timeout: float = 600.0, as_torch: bool | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers,
                                  timeout=timeout)
        self._model, self.as_torch = model, as_torch

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self._json("GET", "/v1/models")["data"][0]["id"]
        return self._model

    # ---------------------------------------------------------------- generation
    def complete(self, prompt, hooks: dict | None = None, **kwargs) -> Completion:
        return self._completion("/v1/completions", {"prompt": prompt}, hooks, kwargs)

    def chat(self, messages: list[dict], hooks: dict | None = None, **kwargs) -> Completion:
        return self._completion("/v1/chat/completions", {"messages": messages}, hooks, kwargs)

    def stream(self, prompt=None, messages: list[dict] | None = None,
               hooks: dict | None = None, **kwargs) -> Stream:
        chat = messages is not None
        body = self._body({"messages": messages} if chat else {"prompt": prompt}, hooks,
                          {**kwargs, "stream": True})
        path = "/v1/chat/completions" if chat else "/v1/completions"
        cm = self._http.stream("POST", path, json=body)
        response = cm.__enter__()
        if response.status_code >= 400:
            response.read()
            cm.__exit__(None, None, None)
            self._raise(response)
        return Stream(response.iter_lines(), chat, self.as_torch,
                      lambda: cm.__exit__(None, None, None))

    def _body(self, base: dict, hooks: dict | None, kwargs: dict) -> dict:
        body = {"model": self.model, **base, **kwargs}
        if hooks is not None:
            body["hooks"] = _jsonable(hooks)
        return body

    def _completion(self, path: str, base: dict, hooks, kwargs) -> Completion:
        data = self._json("POST", path, json=self._body(base, hooks, kwargs))
        chat = path.endswith("chat/completions")
        choices = [Choice((c.get("message") or {}).get("content") if chat else c.get("text"),
                          c.get("finish_reason"), c.get("token_ids"),
                          decode(c.get("hooks"), self.as_torch)) for c in data["choices"]]
        return Completion(choices, data)

    # ---------------------------------------------------------------- named vectors
    def register_vector(self, name: str, vector) -> dict:
        vector = np.asarray(vector.tolist() if hasattr(vector, "tolist") else vector,
                            dtype=np.float32)
        return self._json("POST", "/v1/graphtap/vectors",
                          json={"name": name, "vector": vector.tolist()})["registered"][0]

    def register_vectors_file(self, blob: bytes, name: str | None = None) -> list[dict]:
        """A safetensors file's tensors, each by its key (or `name`, for a file of one)."""
        return self._json("POST", "/v1/graphtap/vectors", content=blob,
                          params={"name": name} if name else None,
                          headers={"content-type": "application/octet-stream"})["registered"]

    def vectors(self) -> list[dict]:
        return self._json("GET", "/v1/graphtap/vectors")["vectors"]

    def delete_vector(self, name: str) -> None:
        self._json("DELETE", f"/v1/graphtap/vectors/{name}")

    # ---------------------------------------------------------------- transport
    def _json(self, method: str, path: str, **kwargs) -> dict:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            self._raise(response)
        return response.json()

    @staticmethod
    def _raise(response: httpx.Response):
        try:
            err = response.json().get("error", {})
            message, param = err.get("message", response.text), err.get("param")
        except ValueError:
            message, param = response.text, None
        raise GraphtapError(response.status_code, message, param)
