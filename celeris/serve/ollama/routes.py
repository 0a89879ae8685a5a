"""The thin routes of Ollama's API under ``/api``: parse the body, translate (``celeris.serve.ollama.serving``), answer
one JSON object or an NDJSON stream (``application/x-ndjson``: one JSON object per line, Ollama's default).

A streamed answer that fails after it began ends with one ``{"error": "..."}`` line (the official client raises
``ResponseError`` on it). A body is read as JSON whatever its Content-Type, as Ollama does (``curl -d`` sends
``application/x-www-form-urlencoded``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from celeris import __version__
from celeris.serve.errors import APIError, parse_request
from celeris.serve.ollama import models
from celeris.serve.ollama.protocol import (
    OLLAMA_API_VERSION,
    ChatChunk,
    ChatRequest,
    GenerateChunk,
    GenerateRequest,
    MessageOut,
    ModelList,
    ShowRequest,
    VersionResponse,
    error_body,
)
from celeris.serve.ollama.serving import answer, chat_request, generate_request, refuse_unsupported, with_ollama_names
from celeris.serve.serving import ClientDisconnected

logger = logging.getLogger(__name__)

# request bodies of the routes, for the OpenAPI document (the routes parse them themselves, strictly)
OLLAMA_BODIES = {"/api/generate": GenerateRequest, "/api/chat": ChatRequest, "/api/show": ShowRequest}
OLLAMA_PATHS = ("/api/generate", "/api/chat", "/api/tags", "/api/show", "/api/ps", "/api/version")
# model management Celeris does not do: (method, path, what it would do)
UNSUPPORTED = (("POST", "/api/pull", "pull"), ("POST", "/api/push", "push"), ("POST", "/api/create", "create"),
               ("POST", "/api/copy", "copy"), ("DELETE", "/api/delete", "delete"), ("POST", "/api/embed", "embed"),
               ("POST", "/api/embeddings", "embed"))
NDJSON_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(exc: APIError) -> JSONResponse:
    """``exc`` in Ollama's error shape with its status code and headers."""
    return JSONResponse(error_body(exc), status_code=exc.status_code, headers=exc.headers)


async def ndjson(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """One JSON line per chunk; a failure after the stream began is one ``{"error": ...}`` line."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk.model_dump_json(exclude_none=True) + "\n"
    except ClientDisconnected:
        return
    except APIError as exc:
        yield json.dumps(error_body(with_ollama_names(exc))) + "\n"
    except Exception as exc:  # a bug must still end the stream in the documented way
        logger.exception("stream failed")
        yield json.dumps({"error": f"internal error: {type(exc).__name__}"}) + "\n"


def respond(result) -> Response:
    """A whole answer is one JSON object, an async iterator an NDJSON stream."""
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(exclude_none=True), media_type="application/json")
    return StreamingResponse(ndjson(result), media_type="application/x-ndjson", headers=NDJSON_HEADERS)


def load_answer(body: GenerateRequest | ChatRequest, chat: bool) -> BaseModel:
    """What Ollama answers a request with nothing to generate: the model is (already) loaded; ``keep_alive: 0``
    asks to unload it, which Celeris does not do (it serves its models for its whole life)."""
    reason = "unload" if body.keep_alive in (0, "0", "0s", "0m") else "load"
    if chat:
        return ChatChunk(model=body.model, message=MessageOut(), done=True, done_reason=reason)
    return GenerateChunk(model=body.model, done=True, done_reason=reason)


def document_model_names(doc: dict, serving) -> None:
    """Write the served names (with and without ``:latest``) as the ``model`` values of the Ollama bodies in the
    OpenAPI document ``doc`` (any other name is a 404), so /docs and schema-driven tests name a served model."""
    names = [n for s in models.servings_of(serving) for n in dict.fromkeys([s.model_name, models.tagged(s.model_name)])]
    schemas = doc.get("components", {}).get("schemas", {})
    for body in OLLAMA_BODIES.values():
        for field in ("model", "name"):
            prop = schemas.get(body.__name__, {}).get("properties", {}).get(field)
            if prop is not None:
                prop.pop("anyOf", None)
                prop.update({"type": "string", "enum": names})


def ollama_router(serving) -> APIRouter:
    """The ``/api`` routes over ``serving`` (an ``OpenAIServing`` or a ``ModelRouter``); include it with the
    app's API-key dependency."""
    router = APIRouter(prefix="/api")

    @router.post("/generate")
    async def generate(request: Request) -> Response:
        body = parse_request(GenerateRequest, await request.body())
        s = models.resolve(serving, body.model)
        refuse_unsupported(body.unsupported())
        if not body.prompt and not body.suffix:
            return respond(load_answer(body, chat=False))
        inner = generate_request(body, s.model_name, s.context_length)
        return respond(await answer(s, inner, body.model, False, body.stream, request.is_disconnected))

    @router.post("/chat")
    async def chat(request: Request) -> Response:
        body = parse_request(ChatRequest, await request.body())
        s = models.resolve(serving, body.model)
        refuse_unsupported(body.unsupported())
        if not body.messages:
            return respond(load_answer(body, chat=True))
        inner = chat_request(body, s.model_name, s.context_length)
        return respond(await answer(s, inner, body.model, True, body.stream, request.is_disconnected))

    @router.get("/tags")
    async def tags() -> Response:
        return respond(ModelList(models=[models.entry(s) for s in models.servings_of(serving)]))

    @router.get("/ps")
    async def ps() -> Response:
        return respond(ModelList(models=[models.entry(s, running=True) for s in models.servings_of(serving)]))

    @router.post("/show")
    async def show(request: Request) -> Response:
        body = parse_request(ShowRequest, await request.body())
        name = body.model or body.name
        if not name:
            raise APIError(400, "missing required parameter: 'model'", param="model")
        return respond(models.show(models.resolve(serving, name)))

    @router.get("/version")
    async def version() -> Response:
        return respond(VersionResponse(version=OLLAMA_API_VERSION, celeris=__version__))

    for method, path, verb in UNSUPPORTED:
        router.add_api_route(path.removeprefix("/api"), _refusal(serving, verb), methods=[method])
    return router


def _refusal(serving, verb: str):
    async def refuse() -> Response:
        served = ", ".join(f"'{models.tagged(s.model_name)}'" for s in models.servings_of(serving))
        what = "compute embeddings" if verb == "embed" else f"{verb} models"
        raise APIError(400, f"Celeris serves the models it was started with ({served}) and cannot {what}; start "
                            "`celeris serve --model ...` (or --also-serve) with the model you need")
    refuse.__name__ = f"refuse_{verb}"
    return refuse
