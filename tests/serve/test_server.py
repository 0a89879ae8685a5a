"""The hardened uvicorn server: header deadline, a bound on open sockets, JSON errors for malformed
HTTP, resource errors logged once, a draining shutdown, and a /health that notices a stuck engine."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import socket
import threading
import time

import httpx
import pytest

from celeris.serve.app import BackgroundServer, create_app
from celeris.serve.server import ServerLimits, _ResourceErrorLog
from tests.serve.conftest import make_serving
from tests.serve.test_limits import LONG, wait_until
from tests.serve.test_middleware import raw_request, status_and_json


@pytest.fixture(scope="module")
def small_server(serve_llm):
    """At most 4 open sockets, 0.5 s to send the request headers."""
    limits = ServerLimits(header_timeout_s=0.5, max_connections=4)
    serving = make_serving(serve_llm)
    with BackgroundServer(create_app(serving, limits=limits), limits=limits) as srv:
        srv.serving = serving
        yield srv


def is_closed(sock: socket.socket, timeout: float = 3.0) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_partial_headers_get_408_and_silent_sockets_are_closed(small_server):
    response, seconds = raw_request(small_server, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    status, body = status_and_json(response)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert 0.4 < seconds < 3
    with socket.create_connection((small_server.host, small_server.port)) as silent:
        start = time.monotonic()
        assert is_closed(silent)
        assert time.monotonic() - start < 3


def test_idle_sockets_cannot_lock_out_new_clients(small_server):
    """4 sockets held open (idle) and a 5th client: the oldest idle one is closed, the client is served."""
    held = [socket.create_connection((small_server.host, small_server.port)) for _ in range(6)]
    try:
        time.sleep(0.1)
        resp = httpx.get(f"{small_server.url}/health", timeout=5)
        assert resp.status_code == 200
        assert sum(is_closed(s, timeout=0.2) for s in held) >= 3
    finally:
        for s in held:
            s.close()


def held_steps(serving) -> threading.Event:
    """Make every engine step of ``serving`` wait until the returned event is set (at most 30 s): its requests stay
    in flight, however slow the machine, until the test lets them go."""
    release = threading.Event()
    engine = serving.async_engine.engine
    real_step = engine.step

    def held_step():
        release.wait(30)
        return real_step()

    engine.step = held_step
    return release


def paced_steps(serving, delay_s: float) -> dict[str, float]:
    """Make every engine step of ``serving`` sleep ``pace["delay_s"]`` seconds first; the returned ``pace`` may be
    changed while it runs (0: the rest at full speed)."""
    pace = {"delay_s": delay_s}
    engine = serving.async_engine.engine
    real_step = engine.step

    def paced_step():
        time.sleep(pace["delay_s"])
        return real_step()

    engine.step = paced_step
    return pace


def test_busy_connections_beyond_the_bound_get_503_in_the_error_shape(serve_llm):
    limits = ServerLimits(max_connections=2)
    serving = make_serving(serve_llm)
    release = held_steps(serving)  # the two requests hold their connections until the third is refused
    with BackgroundServer(create_app(serving, limits=limits), limits=limits) as srv:
        done = []
        threads = [threading.Thread(target=lambda: done.append(
            httpx.post(f"{srv.url}/v1/completions", json=LONG, timeout=30).status_code)) for _ in range(2)]
        for t in threads:
            t.start()
        assert wait_until(lambda: serving.async_engine.num_in_flight == 2)
        try:
            resp = httpx.get(f"{srv.url}/health", timeout=5)
        finally:
            release.set()
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "too_many_connections"
        assert resp.headers["retry-after"] == "1"
        for t in threads:
            t.join()
        assert done == [200, 200]


def test_oversized_headers_get_431_in_the_error_shape(small_server):
    resp = httpx.get(f"{small_server.url}/health", headers={"X-Big": "a" * (1 << 20)}, timeout=10)
    assert resp.status_code == 431
    assert resp.json()["error"]["code"] == "headers_too_large"
    response, _ = raw_request(small_server, "GARBAGE\r\n\r\n")
    status, body = status_and_json(response)
    assert status == 400 and body["error"]["code"] == "invalid_http"


def test_resource_exhaustion_is_logged_once_not_per_accept(caplog):
    loop = asyncio.new_event_loop()
    try:
        handler = _ResourceErrorLog(None)
        with caplog.at_level(logging.ERROR, logger="celeris.serve.server"):
            for _ in range(1000):
                handler(loop, {"message": "socket.accept() out of system resource",
                               "exception": OSError(errno.EMFILE, "Too many open files")})
        assert len(caplog.records) == 1 and "Too many open files" in caplog.records[0].getMessage()
        assert handler.suppressed == 999
    finally:
        loop.close()


def sse_events(resp: httpx.Response) -> list[str]:
    return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


def test_drain_turns_health_503_refuses_new_requests_and_cuts_streams_cleanly(serve_llm):
    """What SIGTERM does: /health 503 at once, new requests 503 + Retry-After; a stream still running
    at the end of the drain period ends with an error event and [DONE]; then the server stops."""
    limits = ServerLimits(drain_timeout_s=0.6)
    serving = make_serving(serve_llm, step_delay=0.05, request_timeout=30)
    srv = BackgroundServer(create_app(serving, limits=limits), limits=limits).start()
    try:
        events: list[str] = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**LONG, "stream": True}, timeout=30) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            srv.drain()
            health = httpx.get(f"{srv.url}/health", timeout=5)
            assert health.status_code == 503 and health.json()["error"]["code"] == "server_shutting_down"
            new = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
            assert new.status_code == 503 and new.headers["retry-after"] == "1"
            assert new.json()["error"]["code"] == "server_shutting_down"
            events = [first[6:], *(line[6:] for line in lines if line.startswith("data: "))]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
        srv.thread.join(10)
        assert not srv.thread.is_alive()
    finally:
        srv.stop()


def test_drain_lets_requests_in_flight_finish(serve_llm):
    limits = ServerLimits(drain_timeout_s=20)
    serving = make_serving(serve_llm, step_delay=0.01)
    srv = BackgroundServer(create_app(serving, limits=limits), limits=limits).start()
    try:
        result = []
        t = threading.Thread(target=lambda: result.append(httpx.post(
            f"{srv.url}/v1/completions", json={**LONG, "max_tokens": 16, "steps": 16}, timeout=30)))
        t.start()
        assert wait_until(lambda: serving.async_engine.num_in_flight == 1)
        srv.drain()
        t.join()
        assert result[0].status_code == 200 and result[0].json()["choices"][0]["finish_reason"]
        srv.thread.join(10)
        assert not srv.thread.is_alive()  # stopped as soon as nothing was in flight, not after 20 s
    finally:
        srv.stop()


def test_a_request_whose_headers_arrived_before_the_drain_runs(serve_llm):
    """In flight means "admitted by the HTTP layer": a body that completes after SIGTERM is still served (not 503)."""
    limits = ServerLimits(drain_timeout_s=20)
    serving = make_serving(serve_llm)
    app = create_app(serving, limits=limits)
    reading, release = threading.Event(), threading.Event()

    async def watched(scope, receive, send):  # tells when the app reads the body: its admission checks are passed
        async def first_receive():
            reading.set()
            return await receive()

        await app(scope, first_receive if scope["type"] == "http" else receive, send)

    watched.state = app.state
    srv = BackgroundServer(watched, limits=limits).start()
    payload = json.dumps({"prompt": "def f(x):", "max_tokens": 8}).encode()

    def body():
        yield payload[:5]
        release.wait(10)
        yield payload[5:]

    try:
        result = []
        t = threading.Thread(target=lambda: result.append(httpx.post(
            f"{srv.url}/v1/completions", content=body(), headers={"content-type": "application/json"}, timeout=30)))
        t.start()
        assert reading.wait(10)
        srv.drain()
        release.set()
        t.join(30)
        assert result[0].status_code == 200, result[0].text
        assert result[0].json()["choices"][0]["finish_reason"] in ("stop", "length")
        srv.thread.join(10)
        assert not srv.thread.is_alive()
    finally:
        release.set()
        srv.stop()


def test_health_fails_on_a_stuck_engine_but_not_on_a_full_queue(serve_llm):
    serving = make_serving(serve_llm, max_num_seqs=1, max_waiting=1)
    release = held_steps(serving)  # a stuck engine
    with BackgroundServer(create_app(serving, stall_timeout_s=0.3)) as srv:
        statuses = []
        threads = [threading.Thread(target=lambda: statuses.append(httpx.post(
            f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30).status_code))
            for _ in range(2)]
        for t in threads:
            t.start()
        assert wait_until(lambda: serving.async_engine.num_in_flight == 2)
        full = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
        assert full.status_code == 429
        assert wait_until(lambda: httpx.get(f"{srv.url}/health").status_code == 503, timeout=3)
        assert httpx.get(f"{srv.url}/health").json()["error"]["code"] == "engine_stalled"
        release.set()
        for t in threads:
            t.join()
        assert statuses == [200, 200]
        assert httpx.get(f"{srv.url}/health").status_code == 200


def test_health_stays_ok_while_a_busy_engine_makes_progress(serve_llm):
    serving = make_serving(serve_llm, max_num_seqs=1, max_waiting=1)
    pace = paced_steps(serving, 0.05)
    # 1 s: 20x one paced step, so a loaded 2-core machine (the other test worker) cannot pass for a stall
    with BackgroundServer(create_app(serving, stall_timeout_s=1.0)) as srv:
        busy = LONG  # 64 steps of 0.05 s: busy > 3 s each, two in turn: beyond the checks below
        threads = [threading.Thread(target=lambda: httpx.post(f"{srv.url}/v1/completions", json=busy, timeout=30))
                   for _ in range(2)]
        for t in threads:
            t.start()
        assert wait_until(lambda: serving.async_engine.num_in_flight == 2)
        assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}, timeout=5).status_code == 429
        for _ in range(30):  # 1.5 s > stall_timeout_s, with the queue full all along
            assert httpx.get(f"{srv.url}/health").status_code == 200
            time.sleep(0.05)
        assert serving.async_engine.num_in_flight == 2  # the queue was still full at the last check
        pace["delay_s"] = 0.0  # the rest of both answers at full speed
        for t in threads:
            t.join()
