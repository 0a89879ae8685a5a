"""uvicorn, hardened: connection-level limits and a draining shutdown.

uvicorn alone has no deadline for receiving request headers, counts idle sockets in its
``limit_concurrency`` and answers it (and malformed requests) in plain text. Here:

* ``GuardedH11Protocol`` (uvicorn's h11 protocol, subclassed): a connection must deliver a request's
  headers within ``header_timeout_s`` of connecting (or of its first byte after a keep-alive
  pause), else it gets 408 and is closed; at most ``max_connections`` sockets are open: a new one
  beyond that closes the oldest idle one (no request in flight), and when none is idle it is
  answered 503 with ``Retry-After``. Malformed requests get 400, oversized headers 431, all in the
  OpenAI error shape.
* ``install_resource_error_logging``: the event loop's "out of system resource" accept errors
  (EMFILE ...) are logged once a minute with a count, not once per accept.
* ``CelerisServer`` (uvicorn.Server): the first SIGTERM/SIGINT starts a drain (``/health`` 503,
  new requests 503 + ``Retry-After``, requests in flight finish); after ``drain_timeout_s`` the rest
  are cut (a stream ends with an error event and ``data: [DONE]``, a plain request gets 503); then
  uvicorn shuts down. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import resource
import signal
import time
from dataclasses import dataclass
from functools import partial

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from celeris.serve.protocol import APIError

logger = logging.getLogger(__name__)

# asyncio accepts up to `backlog` sockets in one burst before any protocol sees them (and so before an
# idle one can be closed): the burst, the model's files, logs and pipes must fit in the reserve.
ACCEPT_BACKLOG = 64
FD_RESERVE = ACCEPT_BACKLOG + 64
RESOURCE_LOG_EVERY_S = 60.0
MAX_BODY_BYTES = 8 << 20
_RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


@dataclass(slots=True)
class ServerLimits:
    """Connection-level limits of one server (all times in seconds).

    Attributes:
        header_timeout_s: from connecting (or a request's first byte) to the end of its headers.
        body_timeout_s: from the end of the headers to the end of the body (``RequestGuard``).
        max_connections: open sockets at most (capped below the process's file-descriptor limit).
        drain_timeout_s: after SIGTERM, how long requests in flight may still run.
        max_body_bytes: largest request body.

    Raises:
        ValueError: a limit that is not a positive finite number.
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024
    drain_timeout_s: float = 30.0
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "drain_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        for name in ("max_connections", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def connection_cap(requested: int) -> int:
    """``requested``, lowered to leave ``FD_RESERVE`` of the soft RLIMIT_NOFILE free (but not below 8)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    return min(requested, max(8, soft - FD_RESERVE))


def raw_error(exc: APIError) -> bytes:
    """A whole HTTP/1.1 response for ``exc`` that closes the connection (written outside h11)."""
    body = exc.response().model_dump_json().encode()
    head = [f"HTTP/1.1 {exc.status_code} {STATUS_PHRASES[exc.status_code].decode()}",
            "content-type: application/json", f"content-length: {len(body)}", "connection: close",
            *[f"{k}: {v}" for k, v in exc.headers.items()]]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def over_capacity(scope, receive, send) -> None:
    """The ASGI app a connection beyond ``max_connections`` gets: 503, then close."""
    from celeris.serve.middleware import send_error

    exc = APIError(503, "the server has too many open connections; retry later", code="too_many_connections",
                   headers={"Retry-After": "1", "Connection": "close"})
    await send_error(send, exc, path=scope.get("path", ""))


class ConnectionGuard:
    """The open connections of one server, oldest first, and its limits."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.max_connections = connection_cap(limits.max_connections)
        self.open: dict[GuardedH11Protocol, None] = {}

    def admit(self, conn: GuardedH11Protocol) -> bool:
        """Register ``conn``; False when the server is full and no idle connection could be closed."""
        self.open[conn] = None
        if len(self.open) <= self.max_connections:
            return True
        for other in self.open:
            if other is not conn and other.is_idle():
                other.close_idle()
                return True
        return False


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline, a bound on open sockets and JSON errors."""

    def __init__(self, *args, guard: ConnectionGuard, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self._deadline: asyncio.TimerHandle | None = None

    def is_idle(self) -> bool:
        """No request in flight: between requests, or still sending headers."""
        return self.cycle is None or self.cycle.response_complete

    def close_idle(self) -> None:
        self.guard.open.pop(self, None)
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(self):
            logger.warning("%d connections open, none idle: answering 503", len(self.guard.open))
            self.app = over_capacity
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.open.pop(self, None)
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()  # idle between requests: uvicorn's keep-alive time-out applies

    def _track(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # the headers are in; the body deadline is RequestGuard's
        elif self._deadline is None and not self.transport.is_closing():
            self._arm()  # the first bytes of the next request: its headers must follow in time

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.guard.limits.header_timeout_s, self._on_header_timeout)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_header_timeout(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or not self.is_idle():
            return
        received = bool(self.conn.trailing_data[0]) or self.conn.their_state is not h11.IDLE
        if received:  # partial headers: say why; a silent socket is just closed
            self.transport.write(raw_error(APIError(
                408, f"the request headers did not arrive within {self.guard.limits.header_timeout_s:g} s",
                code="request_timeout")))
        self.close_idle()

    def send_400_response(self, msg: str) -> None:
        buffered = len(self.conn.trailing_data[0])
        limit = self.config.h11_max_incomplete_event_size or h11._connection.DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        if buffered > limit:
            exc = APIError(431, f"the request headers are larger than the limit of {limit} bytes",
                           code="headers_too_large")
        else:
            exc = APIError(400, "invalid HTTP request", code="invalid_http")
        self.transport.write(raw_error(exc))
        self.transport.close()


class _ResourceErrorLog:
    """An event-loop exception handler: resource exhaustion once per RESOURCE_LOG_EVERY_S, with a count."""

    def __init__(self, previous) -> None:
        self.previous = previous
        self.last = -math.inf
        self.suppressed = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:
            now = time.monotonic()
            if now - self.last < RESOURCE_LOG_EVERY_S:
                self.suppressed += 1
                return
            logger.error("%s: %s (%d more like it since the last report); new connections wait",
                         context.get("message", "out of a system resource"), exc.strerror, self.suppressed)
            self.last, self.suppressed = now, 0
            return
        if self.previous is not None:
            self.previous(loop, context)
        else:
            loop.default_exception_handler(context)


def install_resource_error_logging(loop: asyncio.AbstractEventLoop) -> None:
    if not isinstance(loop.get_exception_handler(), _ResourceErrorLog):
        loop.set_exception_handler(_ResourceErrorLog(loop.get_exception_handler()))


class CelerisServer(uvicorn.Server):
    """uvicorn.Server that drains on the first SIGTERM/SIGINT (see the module docstring).

    Args:
        config: the uvicorn config (its ``http`` is ``GuardedH11Protocol``; see ``make_server``).
        serving: the ``OpenAIServing`` whose requests are drained.
        limits: ``drain_timeout_s`` is read from here.
    """

    def __init__(self, config: uvicorn.Config, serving, limits: ServerLimits) -> None:
        super().__init__(config)
        self.serving = serving
        self.limits = limits
        self.drain_deadline: float | None = None
        self._cut = False

    async def startup(self, sockets=None) -> None:
        install_resource_error_logging(asyncio.get_running_loop())
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.drain_deadline is None and not self.should_exit and sig in (signal.SIGTERM, signal.SIGINT):
            self.begin_drain()
            return
        super().handle_exit(sig, frame)  # a second signal: stop now

    def begin_drain(self) -> None:
        """Start draining (any thread): /health 503, new requests 503, in-flight ones finish."""
        logger.warning("draining: /health answers 503 and new requests 503; requests in flight have %g s",
                       self.limits.drain_timeout_s)
        self.serving.begin_drain()
        self.drain_deadline = time.monotonic() + self.limits.drain_timeout_s

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            busy = self.serving.async_engine.num_in_flight > 0 or any(
                not conn.is_idle() for conn in self.server_state.connections if isinstance(conn, GuardedH11Protocol))
            now = time.monotonic()
            if not busy or now >= self.drain_deadline + self.config.timeout_graceful_shutdown:
                self.should_exit = True
            elif now >= self.drain_deadline and not self._cut:
                self._cut = True
                logger.warning("drain period over: cutting %d request(s) in flight",
                               self.serving.async_engine.num_in_flight)
                self.serving.cut_off()
        return await super().on_tick(counter)


def make_server(app, serving, limits: ServerLimits, log_level: str = "info", **config: object) -> CelerisServer:
    """A ``CelerisServer`` for ``app``; ``config`` goes to ``uvicorn.Config`` (host, port, ...)."""
    guard = ConnectionGuard(limits)
    uv_config = uvicorn.Config(app, http=partial(GuardedH11Protocol, guard=guard), log_level=log_level,
                               lifespan="on", timeout_graceful_shutdown=5, backlog=ACCEPT_BACKLOG, **config)
    return CelerisServer(uv_config, serving, limits)
