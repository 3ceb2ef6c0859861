"""The OpenAI server's guards on request bodies: a body over hook_config.max_request_bytes
is answered with a 413 before it is read, so a huge spec never reaches the parser; a JSON
body that Python's parser cannot take (nested thousands deep: RecursionError, a 500 from
the server; a number of more than 4300 digits: a 400 naming no field) gets a 400 naming
the body before any route sees it."""
from __future__ import annotations

import json

import msgspec


class _TooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: 413 for bodies over `limit` bytes (declared or streamed)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        seen, started = 0, False

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send):
        await refuse(send, 413, "RequestEntityTooLarge",
                     f"body: more than {self.limit} bytes (hook_config.max_request_bytes)")


async def refuse(send, status: int, kind: str, message: str) -> None:
    """An error in the OpenAI server's own shape, from ASGI middleware."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": "body",
                                 "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def json_problem(body: bytes) -> str | None:
    """Why Python's JSON parser would fail on `body` in a way the server does not answer
    cleanly, or None. msgspec (C, no recursion into Python) screens every body in
    milliseconds; only what it refuses is parsed again to tell why."""
    try:
        msgspec.json.decode(body)
        return None
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        pass
    try:
        json.loads(body)
    except RecursionError:
        return "body: JSON nested too deep"
    except ValueError as e:
        if "digits" in str(e):  # int parsing bound (sys.set_int_max_str_digits)
            return "body: a number with more digits than Python parses (4300)"
        return None  # malformed JSON: the server's own 400 says so
    return None


class JsonGuard:
    """ASGI middleware: 400 naming the body for JSON Python cannot parse safely (above);
    reads the body (bounded by BodyLimit outside it) and hands it on unchanged."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers") or []) if scope["type"] == "http" else {}
        if scope["type"] != "http" or scope.get("method") != "POST" or \
                not headers.get(b"content-type", b"").startswith(b"application/json"):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        problem = json_problem(body)
        if problem is not None:
            return await refuse(send, 400, "BadRequestError", problem)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # from here on: the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
