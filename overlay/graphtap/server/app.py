"""The registry's routes under /v1 (so `--api-key` guards them as it guards vLLM's own):

    POST   /v1/graphtap/vectors         {"name": ..., "vector": [...]}, or a safetensors
                                         file body (each tensor by its key, or ?name= for
                                         a file of one)
    GET    /v1/graphtap/vectors         name, dim, norm and sha256 of each
    DELETE /v1/graphtap/vectors/{name}
    GET    /v1/graphtap/stats           what the hook frontend and each worker hold now

A live request keeps its vector whatever happens to the name: names are resolved into
the vector's values when a request is admitted."""
from __future__ import annotations

import json

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from vllm.v1.worker.gpu.hooks import request_frontend

from graphtap.config import load_hook_config
from graphtap.server.limits import BodyLimit, JsonGuard

router = APIRouter()


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error in the OpenAI server's own shape."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError"}[status]
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status)


def _registry(request: Request):
    return request_frontend(request).vectors


@router.post("/v1/graphtap/vectors")
async def register(request: Request):
    frontend = request_frontend(request)
    if frontend.api_servers > 1:
        return error(409, "vectors are registered per API server process and this server "
                          "runs several (--api-server-count); load them at start with "
                          "hook_config.vectors_dir", "name")
    registry, body = frontend.vectors, await request.body()
    try:
        if request.headers.get("content-type", "").startswith("application/json"):
            try:
                doc = json.loads(body)
            except ValueError:
                raise ValueError("body: not valid JSON") from None
            if not isinstance(doc, dict) or set(doc) - {"name", "vector"}:
                raise ValueError('body: expected {"name": ..., "vector": [...]}')
            vectors = [registry.check(doc.get("name"), doc.get("vector"))]
        else:
            vectors = registry.from_safetensors(body, request.query_params.get("name"))
        registry.register(vectors)
    except ValueError as e:
        message = str(e)
        return error(400, message, message.split(":", 1)[0])
    return {"registered": [v.describe() for v in vectors]}


@router.get("/v1/graphtap/vectors")
async def list_vectors(request: Request):
    return {"vectors": _registry(request).list()}


@router.delete("/v1/graphtap/vectors/{name}")
async def delete(name: str, request: Request):
    if not _registry(request).delete(name):
        return error(404, f"name: no registered vector named {name!r}", "name")
    return {"deleted": name}


@router.get("/v1/graphtap/stats")
async def stats(request: Request):
    """What the engine's hook frontend and workers hold now: all zeros (vectors stay
    resident, unheld) once every request has ended, whatever ended them. A worker
    learns which requests ended (an abort, a disconnect) with vLLM's next step, and
    frees them then."""
    workers = None
    try:
        workers = await request.app.state.engine_client.collective_rpc("graphtap_hook_stats")
    except Exception:  # no runner probe (graphtap serve adds it): the frontend's alone
        pass
    return {"frontend": request_frontend(request).stats(), "workers": workers}


def attach(app: FastAPI, args) -> None:
    config = load_hook_config(getattr(args, "hook_config", None))
    app.include_router(router)
    # The last added runs first: the size bound, then the JSON guard on bounded bodies.
    app.add_middleware(JsonGuard)
    app.add_middleware(BodyLimit, limit=config.max_request_bytes)
