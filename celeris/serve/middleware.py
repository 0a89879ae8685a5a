"""Pure ASGI middleware guarding every HTTP request before the app sees it.

``RequestGuard`` (inside the metrics middleware, outside routing) gives each request an id
(``X-Request-Id``: the client's, else a new one) that is echoed in the response and added to log
lines; refuses new requests while the server drains for shutdown (503 + ``Retry-After``); refuses a
body by its ``Content-Length`` before reading it (413); and while the app reads the body, stops at
the size limit (413, also for chunked uploads) and at the body deadline (408). A bug's exception is
logged once, with the request id, and answered 500 in the error shape (Starlette's outermost
middleware would log it a second time). Nothing is buffered here, so streams and disconnect
detection are untouched. Connection-level limits (header deadline, open sockets) live in
``celeris.serve.server``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Callable
from contextvars import ContextVar

from celeris.serve.ollama.protocol import error_bytes as ollama_error_bytes
from celeris.serve.ollama.protocol import is_ollama_path
from celeris.serve.protocol import APIError

logger = logging.getLogger(__name__)

REQUEST_ID: ContextVar[str | None] = ContextVar("celeris_request_id", default=None)
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,128}$")  # anything else is replaced, never logged raw
RETRY_AFTER_S = 1


def error_bytes(exc: APIError, path: str = "") -> bytes:
    """``exc`` in the error shape of the API ``path`` belongs to (Ollama's under /api, else OpenAI's)."""
    return ollama_error_bytes(exc) if is_ollama_path(path) else exc.response().model_dump_json().encode()


async def send_error(send, exc: APIError, extra_headers: list[tuple[bytes, bytes]] = (), path: str = "") -> None:
    """Send ``exc`` as a complete JSON response on an ASGI ``send`` (in the shape of ``path``'s API)."""
    body = error_bytes(exc, path)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *[(k.lower().encode(), v.encode()) for k, v in exc.headers.items()], *extra_headers]
    await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class RequestIdFilter(logging.Filter):
    """Appends ``[request_id=...]`` to records logged while a request is handled."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = REQUEST_ID.get()
        if rid and not getattr(record, "request_id", None):
            record.request_id = rid
            record.msg = f"{record.msg} [request_id={rid}]"
        return True


def install_request_id_logging(names: tuple[str, ...] = ("uvicorn.access", "uvicorn.error", "celeris.serve.app",
                                                          "celeris.serve.serving", __name__)) -> None:
    """Add ``RequestIdFilter`` to these loggers (once each)."""
    for name in names:
        log = logging.getLogger(name)
        if not any(isinstance(f, RequestIdFilter) for f in log.filters):
            log.addFilter(RequestIdFilter())


class RequestGuard:
    """See the module docstring.

    Args:
        app: the ASGI app.
        max_body_bytes: largest request body accepted (413 beyond, ``Connection: close``).
        body_timeout_s: seconds from the end of the request headers to the end of its body (408 after).
        is_draining: True once the server drains for shutdown; then every request but ``/health``
            and ``/metrics`` gets 503 with ``Retry-After``.
    """

    def __init__(self, app, max_body_bytes: int, body_timeout_s: float, is_draining: Callable[[], bool]) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.is_draining = is_draining

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1").strip()
        rid = given if _REQUEST_ID_RE.match(given) else uuid.uuid4().hex
        token = REQUEST_ID.set(rid)
        scope.setdefault("state", {})["request_id"] = rid

        started = False

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            refusal = self._refusal(scope, headers)
            if refusal is not None:
                await send_error(send_with_id, refusal, path=scope.get("path", ""))
                return
            await self.app(scope, self._guarded_receive(receive), send_with_id)
        except Exception as exc:  # a bug: one traceback, then the error shape if nothing was sent yet
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await send_error(send_with_id, APIError(500, f"internal error: {type(exc).__name__}"),
                                 path=scope.get("path", ""))
        finally:
            REQUEST_ID.reset(token)

    def _refusal(self, scope, headers: dict[bytes, bytes]) -> APIError | None:
        if self.is_draining() and scope.get("path") not in ("/health", "/metrics"):
            return APIError(503, "the server is shutting down and takes no new requests; retry on another replica",
                            code="server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return APIError(400, "the Content-Length header must be a non-negative integer",
                                code="invalid_content_length", headers={"Connection": "close"})
            if len(length) > 18 or int(length) > self.max_body_bytes:
                return APIError(413, f"the request body is {length.decode()} bytes, more than the limit of "
                                     f"{self.max_body_bytes}", code="body_too_large", headers={"Connection": "close"})
        return None

    def _guarded_receive(self, receive):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        received = 0
        body_done = False

        async def guarded() -> dict:
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                               code="request_timeout", headers={"Connection": "close"}) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:  # a chunked upload: stop reading at the limit
                    raise APIError(413, f"the request body is more than the limit of {self.max_body_bytes} bytes",
                                   code="body_too_large", headers={"Connection": "close"})
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        return guarded
