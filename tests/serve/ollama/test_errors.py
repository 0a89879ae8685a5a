"""Malformed requests to Ollama's routes answer in Ollama's error shape, ``{"error": "..."}`` and nothing else, with
the right status (400 bad request, 404 unknown model or route, 405, 413), never a 5xx; the model-management routes
say Celeris serves the models it was started with; the routes are in /openapi.json and counted in /metrics."""

from __future__ import annotations

import json

import pytest

from celeris.serve.app import create_app
from tests.serve.conftest import CONTEXT, MODEL_NAME, make_serving

USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL_NAME, "messages": USER, "stream": False}
GEN = {"model": MODEL_NAME, "prompt": "def f(x):", "stream": False}
BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
ARRAY_ARGS = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[]"}}]}]

# (path, body, status, words the message must contain)
CASES = [
    ("/api/chat", b"{", 400, "not valid JSON"),
    ("/api/chat", b"[1, 2]", 400, "JSON object"),
    ("/api/chat", {"messages": USER}, 400, "'model'"),
    ("/api/chat", {"model": "", "messages": USER}, 400, "model"),
    ("/api/chat", {**CHAT, "model": "llama3.2:latest"}, 404, "not found"),
    ("/api/chat", {**CHAT, "bogus": 1}, 400, "bogus"),
    ("/api/chat", {**CHAT, "options": {"bogus": 1}}, 400, "options.bogus"),
    ("/api/chat", {**CHAT, "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ("/api/chat", {**CHAT, "options": {"temperature": -1}}, 400, "temperature"),
    ("/api/chat", {**CHAT, "options": {"mirostat": 2}}, 400, "options.mirostat"),
    ("/api/chat", {**CHAT, "options": {"num_ctx": CONTEXT + 1}}, 400, f"context of {CONTEXT}"),
    ("/api/chat", {**CHAT, "options": {"num_predict": 0}}, 400, "num_predict"),
    ("/api/chat", {**CHAT, "options": {"num_predict": CONTEXT}}, 400, f"options.num_predict ({CONTEXT})"),
    ("/api/chat", {**CHAT, "options": {"steps": 0}}, 400, "steps"),
    ("/api/chat", {**CHAT, "options": {"stop": [""]}}, 400, "'options.stop'"),
    ("/api/chat", {**CHAT, "options": {"tool_choice": "required"}}, 400, "tool_choice"),
    ("/api/chat", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/api/chat", {**CHAT, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400, "images"),
    ("/api/chat", {**CHAT, "messages": ARRAY_ARGS}, 400, "arguments"),
    ("/api/chat", {**CHAT, "format": "xml"}, 400, "format"),
    ("/api/chat", {**CHAT, "format": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, 400,
     "'format' is not a valid JSON Schema"),
    ("/api/chat", {**CHAT, "tools": [BAD_TOOL]}, 400, "parameters"),
    ("/api/chat", {**CHAT, "think": True}, 400, "think"),
    ("/api/chat", {**CHAT, "logprobs": True}, 400, "logprobs"),
    ("/api/chat", {**CHAT, "messages": [{"role": "user", "content": "x" * 20000}]}, 400, "context window"),
    ("/api/generate", {**GEN, "template": "{{ .Prompt }}"}, 400, "template"),
    ("/api/generate", {**GEN, "context": [1, 2, 3]}, 400, "context"),
    ("/api/generate", {**GEN, "system": "s", "raw": True}, 400, "system"),
    ("/api/generate", {**GEN, "steps": 4}, 400, "go in options.steps"),
    ("/api/generate", {**GEN, "prompt": 7}, 400, "prompt"),
    ("/api/generate", {**GEN, "suffix": "x", "options": {"suffix_window": 4}}, 400, "suffix"),
    ("/api/generate", {**GEN, "options": {"tool_choice": "auto"}}, 400, "tool_choice"),
    ("/api/show", {}, 400, "'model'"),
    ("/api/show", {"model": "nope"}, 404, "not found"),
    ("/api/show", {"name": MODEL_NAME, "extra": 1}, 400, "extra"),
]


def check_shape(response, status: int) -> str:
    """The body is exactly ``{"error": <text>}`` with ``status``; returns the text."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert list(body) == ["error"] and isinstance(body["error"], str) and body["error"]
    return body["error"]


@pytest.mark.parametrize(("path", "body", "status", "words"), CASES)
def test_malformed_requests_answer_in_ollama_shape(http, path, body, status, words):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert words in check_shape(http.post(path, content=raw), status)


def test_a_body_is_json_whatever_its_content_type(http):
    """As Ollama: ``curl -d`` sends a form content type."""
    response = http.post("/api/generate", content=json.dumps({**GEN, "options": {"num_predict": 4}}),
                         headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200 and response.json()["done"] is True


@pytest.mark.parametrize(("method", "path"), [("POST", "/api/pull"), ("POST", "/api/push"), ("POST", "/api/create"),
                                              ("POST", "/api/copy"), ("DELETE", "/api/delete"),
                                              ("POST", "/api/embed"), ("POST", "/api/embeddings")])
def test_model_management_is_refused(http, method, path):
    message = check_shape(http.request(method, path, json={"model": "llama3.2"}), 400)
    assert "serves the models it was started with" in message and f"'{MODEL_NAME}:latest'" in message


def test_unknown_routes_methods_and_large_bodies(http, ollama_server):
    assert "no route" in check_shape(http.get("/api/nothing"), 404)
    assert "not allowed" in check_shape(http.get("/api/chat"), 405)
    big = b'{"model": "x", "prompt": "' + b"a" * (ollama_server.server.limits.max_body_bytes + 1) + b'"}'
    assert "limit" in check_shape(http.post("/api/generate", content=big), 413)
    assert "API key" in check_shape(http.post("/api/chat", json=CHAT, headers={"Authorization": "Bearer no"}), 401)
    # the OpenAI routes keep their own shape
    assert set(http.post("/v1/chat/completions", content=b"{").json()["error"]) == {"message", "type", "param", "code"}


def test_a_failure_after_the_stream_began_is_an_error_line(http, ollama_server, monkeypatch):
    """The engine fails mid-stream: the NDJSON stream ends with one ``{"error": ...}`` line (a 200 was sent)."""
    engine = ollama_server.serving.async_engine.engine
    real = engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("boom")
        return real()

    monkeypatch.setattr(engine, "step", failing_step)
    with http.stream("POST", "/api/generate", json={**GEN, "stream": True, "options": {"num_predict": 16}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert list(lines[-1]) == ["error"] and not any(line.get("done") for line in lines)


def test_routes_are_in_openapi_and_metrics(serve_llm, http):
    doc = create_app(make_serving(serve_llm)).openapi()  # no key: the schema is served
    for path in ("/api/generate", "/api/chat", "/api/show"):
        assert doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert {"/api/tags", "/api/ps", "/api/version", "/api/pull", "/api/delete"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    for body in ("GenerateRequest", "ChatRequest", "ShowRequest"):  # the served names, so /docs names one
        assert schemas[body]["properties"]["model"]["enum"] == [MODEL_NAME, f"{MODEL_NAME}:latest"]
    http.get("/api/tags")
    http.post("/api/chat", content=b"{")
    text = http.get("/metrics").text
    assert 'celeris_http_requests_total{path="/api/tags",status="200"}' in text
    assert 'celeris_http_requests_total{path="/api/chat",status="400"}' in text
