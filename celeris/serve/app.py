"""Thin HTTP routes over OpenAIServing: parse the body, call the serving layer, answer JSON or SSE.

Every failure leaves as one ErrorResponse shape (``{"error": {message, type, param, code}}``)
through the exception handlers below; client mistakes are 4xx, never 500.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from celeris.serve.metrics import MetricsMiddleware, ServerMetrics
from celeris.serve.middleware import REQUEST_ID, RequestGuard, install_request_id_logging
from celeris.serve.models_router import ModelRouter
from celeris.serve.ollama.protocol import is_ollama_path
from celeris.serve.ollama.routes import OLLAMA_BODIES, document_model_names, ollama_router
from celeris.serve.ollama.routes import error_response as ollama_error_response
from celeris.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    errors_to_api_error,
    parse_json_body,
    parse_request,
    validation_error,
)
from celeris.serve.responses.protocol import ResponsesRequest
from celeris.serve.responses.routes import responses_router
from celeris.serve.responses.serving import ResponsesServing
from celeris.serve.server import ServerLimits, make_server
from celeris.serve.serving import ClientDisconnected, OpenAIServing
from celeris.serve.tokenization import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    detokenize,
    tokenize,
    tokenize_request_model,
    tokenizer_info,
)

logger = logging.getLogger(__name__)

STALL_TIMEOUT_S = 10.0  # /health fails when requests are in flight and no engine step completed for this long
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(exc: APIError, path: str = "") -> JSONResponse:
    """``exc`` in the error shape of the API ``path`` belongs to (Ollama's under /api, else OpenAI's)."""
    if is_ollama_path(path):
        return ollama_error_response(exc)
    return JSONResponse(exc.response().model_dump(mode="json"), status_code=exc.status_code, headers=exc.headers)


async def json_body(request: Request) -> bytes:
    """The raw body of a JSON request: 415 for another content type (RequestGuard bounds its size and time)."""
    content_type = request.headers.get("content-type", "")
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"Content-Type must be application/json, got '{content_type or 'none'}'",
                       code="unsupported_media_type")
    return await request.body()


async def sse(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Server-sent events: ``data: {chunk}`` per chunk; an error event on failure; then ``data: [DONE]``."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield f"data: {chunk.model_dump_json()}\n\n"
    except ClientDisconnected:
        return
    except APIError as exc:
        yield f"data: {exc.response().model_dump_json()}\n\n"
    except Exception as exc:  # a bug must still end the stream in the documented way
        logger.exception("stream failed")
        yield f"data: {APIError(500, f'internal error: {type(exc).__name__}').response().model_dump_json()}\n\n"
    yield "data: [DONE]\n\n"


def respond(result) -> Response:
    """The only choice a route makes: a full response is JSON, an async iterator is SSE."""
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(), media_type="application/json")
    return StreamingResponse(sse(result), media_type="text/event-stream", headers=SSE_HEADERS)


def openapi_with_bodies(app: FastAPI) -> dict:
    """The app's OpenAPI document with the request bodies the routes parse themselves (strict JSON, see
    ``parse_request``), so /docs and schema-driven tests see them."""
    from fastapi.openapi.utils import get_openapi
    from pydantic.json_schema import models_json_schema

    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        bodies = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                  "/v1/responses": ResponsesRequest, "/detokenize": DetokenizeRequest, **OLLAMA_BODIES}
        _, defs = models_json_schema([(m, "validation") for m in bodies.values()],
                                     ref_template="#/components/schemas/{model}")
        doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        _, more = models_json_schema([(m, "validation") for m in (TokenizeCompletionRequest, TokenizeChatRequest)],
                                     ref_template="#/components/schemas/{model}")
        doc["components"]["schemas"].update(more.get("$defs", {}))
        for path, model in bodies.items():
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        doc["paths"]["/tokenize"]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"anyOf": [{"$ref": f"#/components/schemas/{m.__name__}"}
                                 for m in (TokenizeCompletionRequest, TokenizeChatRequest)]}}}}
        document_model_names(doc, app.state.serving)
        app.openapi_schema = doc
    return app.openapi_schema


def tokenizer_router(serving: OpenAIServing | ModelRouter, check_api_key) -> APIRouter:
    """vLLM's tokenizer routes at the root (``celeris.serve.tokenization``), behind the API key as /v1 is (the body
    limits apply to every route)."""
    router = APIRouter(dependencies=[Depends(check_api_key)])

    def target(model: str | None) -> OpenAIServing:
        return serving.pick(model) if isinstance(serving, ModelRouter) else serving

    @router.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        raw = await json_body(request)
        body = parse_request(tokenize_request_model(parse_json_body(raw)), raw)
        return respond(tokenize(target(body.model), body))

    @router.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        body = parse_request(DetokenizeRequest, await json_body(request))
        return respond(detokenize(target(body.model), body))

    @router.get("/tokenizer_info")
    async def tokenizer_info_route() -> Response:
        return JSONResponse(tokenizer_info(target(None)))

    return router


def check_api_key_value(api_key: str | None) -> None:
    """Refuse a key no client could send as meant: empty, or with surrounding whitespace.

    Raises:
        ValueError: naming the problem.
    """
    if api_key is None:
        return
    if not api_key:
        raise ValueError("the API key is empty; give a non-empty key, or none to turn authentication off")
    if api_key != api_key.strip():
        raise ValueError("the API key has leading or trailing whitespace, which a bearer token cannot carry")


PLAYGROUND = Path(__file__).parent / "static"
# The playground's Content-Security-Policy (W3C CSP Level 3): scripts, styles and requests only from this server,
# so no inline script or event handler runs even if markup got into the page; the page is never framed.
PLAYGROUND_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                  "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
                  "frame-ancestors 'none'")
NOSNIFF = {"X-Content-Type-Options": "nosniff"}  # a file is run only as the type it is served as


def mount_playground(app: FastAPI) -> None:
    """The playground page at ``/`` (with ``PLAYGROUND_CSP``) and its files under ``/static`` (package data; open
    even with an API key: the page asks for the key and sends it on its /v1 calls); all with ``nosniff``."""
    from fastapi.staticfiles import StaticFiles

    class PlaygroundFiles(StaticFiles):
        async def get_response(self, path: str, scope) -> Response:
            response = await super().get_response(path, scope)
            response.headers.update(NOSNIFF)
            return response

    @app.get("/", include_in_schema=False)
    async def playground() -> Response:
        return Response((PLAYGROUND / "index.html").read_bytes(), media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache", "Content-Security-Policy": PLAYGROUND_CSP, **NOSNIFF})

    app.mount("/static", PlaygroundFiles(directory=PLAYGROUND), name="static")


def _install_error_handlers(app: FastAPI) -> None:
    """Every error as the one OpenAI error shape (``error_response``): APIError, request validation, pydantic
    validation, Starlette's 404/405, a client that left (499, no body) and anything unexpected (500, logged)."""

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(errors_to_api_error(exc.errors()), request.url.path)

    @app.exception_handler(ValidationError)
    async def on_validation(request: Request, exc: ValidationError) -> JSONResponse:
        return error_response(validation_error(exc), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        messages = {404: f"no route for {request.method} {request.url.path}",
                    405: f"method {request.method} is not allowed on {request.url.path}"}
        message = messages.get(exc.status_code, str(exc.detail))
        return error_response(APIError(exc.status_code, message, headers=dict(exc.headers or {})), request.url.path)

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(ClientDisconnect)
    async def on_upload_disconnect(request: Request, exc: ClientDisconnect) -> Response:
        logger.info("client disconnected while sending the body of %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_exception(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s (request id %s)", request.url.path, REQUEST_ID.get())
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"), request.url.path)


def api_key_dependency(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """The FastAPI dependency that checks ``Authorization: Bearer <api_key>`` (no check when ``api_key`` is
    None); a missing or wrong key is a 401 ``invalid_api_key`` with ``WWW-Authenticate: Bearer``."""

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check_api_key


def _v1_router(serving: OpenAIServing | ModelRouter, check_api_key: Callable[[Request], Awaitable[None]]
               ) -> APIRouter:
    """The OpenAI routes under /v1 (completions, chat completions, models), behind ``check_api_key``."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body = parse_request(CompletionRequest, await json_body(request))
        return respond(await serving.create_completion(body, request.is_disconnected))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_request(ChatCompletionRequest, await json_body(request))
        return respond(await serving.create_chat_completion(body, request.is_disconnected))

    @v1.get("/models")
    async def models() -> Response:
        return respond(serving.show_models())

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return respond(serving.show_model(model_id))

    return v1


def _add_health_and_metrics(app: FastAPI, serving: OpenAIServing | ModelRouter, stall_timeout_s: float) -> None:
    """/health (200 while the server can make progress, else 503 naming why) and /metrics (Prometheus)."""

    @app.get("/health")
    async def health() -> Response:
        """200 while the server can make progress. 503 when draining for shutdown, when the engine loop
        is not running, or when requests are in flight and no step completed for ``stall_timeout_s``.
        A full queue (429s) alone never fails it."""
        if serving.draining:
            raise APIError(503, "the server is draining for shutdown", code="server_shutting_down",
                           headers={"Retry-After": "1"})
        if not serving.async_engine.is_running:
            raise APIError(503, "the engine loop is not running", code="engine_unavailable")
        stalled = serving.async_engine.seconds_without_progress()
        if stalled > stall_timeout_s:
            raise APIError(503, f"the engine has completed no step for {stalled:.0f} s while requests are in flight "
                                f"(limit {stall_timeout_s:g} s)", code="engine_stalled")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = serving.metrics.render()
        return Response(body, media_type=content_type)


def create_app(serving: OpenAIServing | ModelRouter, api_key: str | None = None, manage_engine: bool = True,
               limits: ServerLimits | None = None, stall_timeout_s: float = STALL_TIMEOUT_S) -> FastAPI:
    """The FastAPI app for one serving layer.

    Args:
        serving: the serving layer, or a ``ModelRouter`` over several (engine loops are started and stopped
            with the app when ``manage_engine``).
        api_key: when set, /v1 and /api routes require ``Authorization: Bearer <api_key>`` (401 otherwise),
            and the interactive docs (/docs, /redoc, /openapi.json) are off.
        limits: body size and body deadline (``RequestGuard``); the defaults when None.
        stall_timeout_s: /health answers 503 when requests are in flight and no engine step has
            completed for this many seconds.

    Raises:
        ValueError: an empty API key, or one with surrounding whitespace.
    """
    check_api_key_value(api_key)
    limits = limits or ServerLimits()
    install_request_id_logging()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            serving.start()
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.to_thread(serving.stop)

    docs = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Celeris", summary="OpenAI-compatible server for diffusion language models",
                  lifespan=lifespan, **docs)
    app.state.serving = serving
    app.add_middleware(RequestGuard, max_body_bytes=limits.max_body_bytes, body_timeout_s=limits.body_timeout_s,
                       is_draining=lambda: serving.draining)
    app.add_middleware(MetricsMiddleware, metrics=serving.metrics)  # outermost: counts RequestGuard's refusals too

    _install_error_handlers(app)

    check_api_key = api_key_dependency(api_key)
    v1 = _v1_router(serving, check_api_key)
    app.state.responses = ResponsesServing(serving)  # the store lives here, in the process that serves HTTP
    v1.include_router(responses_router(app.state.responses, json_body))
    app.include_router(v1)
    app.include_router(ollama_router(serving), dependencies=[Depends(check_api_key)])  # Ollama's API
    app.include_router(tokenizer_router(serving, check_api_key))
    app.openapi = lambda: openapi_with_bodies(app)

    _add_health_and_metrics(app, serving, stall_timeout_s)
    mount_playground(app)

    return app


class BackgroundServer:
    """Runs an app with uvicorn on a background thread (tests, load tests, notebooks).

    Binds the socket itself, so ``port=0`` gets a free port with no race; ``url`` is the base URL.
    The server is a ``CelerisServer`` with ``limits`` (``drain()`` starts its shutdown drain).
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 limits: ServerLimits | None = None) -> None:
        self.host = host
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.server = make_server(app, app.state.serving, limits or ServerLimits(), log_level=log_level)
        self.server.config.timeout_graceful_shutdown = 2
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="celeris-uvicorn")

    def drain(self) -> None:
        """What SIGTERM does to ``celeris serve``: drain, then stop."""
        self.server.begin_drain()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_server(
    model: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    request_timeout: float = 60.0,
    api_key: str | None = None,
    served_model_name: str | None = None,
    log_level: str = "info",
    limits: ServerLimits | None = None,
    also_serve: list[str | Path] | None = None,
    **llm_kwargs: Any,
) -> int:
    """Load a checkpoint and serve it until SIGTERM/SIGINT, then drain (``celeris serve``).

    ``llm_kwargs`` go to ``OpenAIServing.from_model`` (``LLM``'s load options and any ``EngineConfig`` field;
    ``max_waiting`` defaults to ``SERVER_MAX_WAITING``); ``tokenizer`` and ``chat_template`` among them replace
    those of ``model`` only. ``also_serve``: more checkpoints served beside it (each named by its folder;
    requests choose by ``model``).

    Raises:
        ValueError: two models with the same name, or a bad API key.
    """
    check_api_key_value(api_key)
    limits = limits or ServerLimits()
    shared = ServerMetrics()
    own = {k: llm_kwargs.pop(k) for k in ("tokenizer", "chat_template") if k in llm_kwargs}
    options = dict(request_timeout=request_timeout, metrics=shared, **llm_kwargs)
    servings = [OpenAIServing.from_model(model, served_model_name=served_model_name, **options, **own)]
    servings += [OpenAIServing.from_model(extra, **options) for extra in also_serve or []]
    serving = servings[0] if len(servings) == 1 else ModelRouter(servings)
    app = create_app(serving, api_key=api_key, limits=limits)
    logger.info("serving %s on http://%s:%d (playground: http://%s:%d/)", ", ".join(s.model_name for s in servings),
                host, port, host, port)
    make_server(app, serving, limits, log_level=log_level, host=host, port=port).run()
    return 0
