"""RequestGuard: body size refused before reading (Content-Length) and at the limit (chunked), the body
deadline, X-Request-Id in responses and logs, and an upload the client abandons logs one line."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from celeris.serve.app import BackgroundServer, create_app
from celeris.serve.server import ServerLimits
from tests.serve.conftest import make_serving
from tests.serve.test_limits import metric


@pytest.fixture(scope="module")
def guarded(serve_llm):
    """A server with a 64 KiB body limit and a 0.5 s body deadline."""
    limits = ServerLimits(max_body_bytes=64 << 10, body_timeout_s=0.5, header_timeout_s=2.0)
    serving = make_serving(serve_llm)
    with BackgroundServer(create_app(serving, limits=limits), limits=limits) as srv:
        srv.serving = serving
        yield srv


def raw_request(server, head: str, body: bytes = b"", timeout: float = 5.0) -> tuple[bytes, float]:
    """Send ``head`` (+ ``body``) on a fresh socket, without finishing anything else; returns what the
    server answered before closing (or the time-out) and the seconds it took."""
    start = time.monotonic()
    with socket.create_connection((server.host, server.port), timeout=timeout) as sock:
        sock.sendall(head.encode() + body)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except (TimeoutError, ConnectionResetError):
            pass
    return b"".join(chunks), time.monotonic() - start


def status_and_json(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_content_length_over_the_limit_is_refused_before_reading(guarded):
    # 256 MB announced, none sent: the old server waited for the body (and buffered it all before the 413).
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {256 << 20}\r\n\r\n")
    response, seconds = raw_request(guarded, head)
    status, body = status_and_json(response)
    assert status == 413 and body["error"]["code"] == "body_too_large"
    assert b"connection: close" in response.lower()
    assert seconds < 2
    assert metric(guarded, "celeris_http_requests_total", path="/v1/completions", status="413") >= 1


def test_chunked_upload_stops_at_the_limit(guarded):
    head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 16384
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8))  # 128 KiB, no final chunk
    response, seconds = raw_request(guarded, head, body)
    status, err = status_and_json(response)
    assert status == 413 and err["error"]["code"] == "body_too_large"
    assert seconds < 2  # answered at the limit, not after a body that never ends


def test_a_body_that_stops_arriving_gets_408(guarded):
    head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n")
    response, seconds = raw_request(guarded, head, b'{"prompt": ')
    status, err = status_and_json(response)
    assert status == 408 and err["error"]["code"] == "request_timeout"
    assert 0.4 < seconds < 3


def test_small_bodies_still_pass(guarded):
    resp = httpx.post(f"{guarded.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert resp.status_code == 200


def test_request_id_is_echoed_and_logged(guarded, caplog):
    resp = httpx.post(f"{guarded.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                      headers={"X-Request-Id": "trace-42"}, timeout=30)
    assert resp.headers["x-request-id"] == "trace-42"
    generated = httpx.get(f"{guarded.url}/health").headers["x-request-id"]
    assert len(generated) == 32  # a fresh id when the client sends none
    unsafe = httpx.get(f"{guarded.url}/health", headers={"X-Request-Id": "a b\tc"}).headers["x-request-id"]
    assert unsafe != "a b\tc"  # never echoed raw
    with caplog.at_level(logging.INFO, logger="celeris.serve.app"):
        with socket.create_connection((guarded.host, guarded.port)) as sock:  # upload abandoned half-way
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"X-Request-Id: upload-7\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
            time.sleep(0.1)
        deadline = time.monotonic() + 5
        while "disconnected" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    records = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(records) == 1 and not records[0].exc_info  # one line, no traceback
    assert "[request_id=upload-7]" in records[0].getMessage()


def test_a_bug_is_a_500_in_the_error_shape_with_one_traceback(guarded, caplog, monkeypatch):
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(guarded.serving, "show_models", broken)
    with caplog.at_level(logging.ERROR):
        resp = httpx.get(f"{guarded.url}/v1/models", headers={"X-Request-Id": "bug-1"})
        time.sleep(0.2)
    assert resp.status_code == 500 and resp.json()["error"]["message"] == "internal error: RuntimeError"
    assert resp.headers["x-request-id"] == "bug-1"
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and "[request_id=bug-1]" in tracebacks[0].getMessage()
