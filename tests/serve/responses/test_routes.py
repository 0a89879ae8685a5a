"""The Responses routes over HTTP: every malformed or unsupported request is a 400 (404 for an unknown model or
stored id, 415 for another content type) in the one error shape, never a 5xx; the API key guards them; they are
in /openapi.json and counted by route in /metrics."""

from __future__ import annotations

import httpx
import openai
import pytest

from celeris.serve.app import BackgroundServer, create_app
from tests.serve.conftest import MODEL_NAME, make_serving


def post(server, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json=body, timeout=30, **kwargs)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "conversation": {"id": "conv_1"}}, "conversation"),
    ({"input": "hi", "frequency_penalty": 3}, "frequency_penalty"),
    ({"input": "hi", "max_output_tokens": "8"}, "max_output_tokens"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     "tools[0].parameters"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "nonsense"}}}},
     "text.format.schema"),
    ({"input": "hi", "steps": 0}, "steps"),
    ({"input": "hi " * 3000}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
])
def test_bad_requests_are_400_naming_the_field(rserver, body, param):
    assert error_of(post(rserver, {"model": MODEL_NAME, **body}), 400)["param"] == param


def test_unknown_model_and_ids_are_404_and_other_content_types_415(rserver):
    assert error_of(post(rserver, {"model": "other", "input": "hi"}), 404)["code"] == "model_not_found"
    assert error_of(httpx.get(f"{rserver.url}/v1/responses/resp_x"), 404)["code"] == "response_not_found"
    assert error_of(httpx.delete(f"{rserver.url}/v1/responses/resp_x"), 404)["code"] == "response_not_found"
    response = httpx.post(f"{rserver.url}/v1/responses", content=b"{}", headers={"content-type": "text/plain"})
    assert error_of(response, 415)["code"] == "unsupported_media_type"
    bad_json = httpx.post(f"{rserver.url}/v1/responses", content=b"{", headers={"content-type": "application/json"})
    assert error_of(bad_json, 400)["code"] == "invalid_json"


def test_a_stream_is_typed_server_sent_events(rserver):
    body = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{rserver.url}/v1/responses", json=body, timeout=30) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    assert len(names) * 2 == len(lines) and names[0] == "response.created" and names[-1] in (
        "response.completed", "response.incomplete")
    assert "[DONE]" not in lines[-1]


def test_openapi_lists_the_routes_with_the_request_body(rserver):
    doc = httpx.get(f"{rserver.url}/openapi.json").json()
    body = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ResponsesRequest"}
    assert "input" in doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert {"get", "delete"} <= set(doc["paths"]["/v1/responses/{response_id}"])


def test_metrics_count_the_routes(rserver):
    post(rserver, {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2})
    httpx.get(f"{rserver.url}/v1/responses/resp_x")
    text = httpx.get(f"{rserver.url}/metrics").text
    assert 'celeris_http_requests_total{path="/v1/responses",status="200"}' in text
    assert 'celeris_http_requests_total{path="/v1/responses/{response_id}",status="404"}' in text


def test_the_api_key_guards_the_routes(responses_llm):
    with BackgroundServer(create_app(make_serving(responses_llm), api_key="secret")) as srv:
        for response in (httpx.post(f"{srv.url}/v1/responses", json={"input": "hi"}),
                         httpx.get(f"{srv.url}/v1/responses/resp_x")):
            assert error_of(response, 401)["code"] == "invalid_api_key"
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="secret", max_retries=0)
        r = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2)
        assert client.responses.retrieve(r.id).id == r.id


def test_model_picks_the_served_model_behind_a_router(responses_llm):
    from celeris.serve.metrics import ServerMetrics
    from celeris.serve.models_router import ModelRouter
    from celeris.serve.serving import OpenAIServing

    metrics = ServerMetrics()
    router = ModelRouter([OpenAIServing(responses_llm, served_model_name=name, metrics=metrics)
                          for name in ("first", "second")])
    with BackgroundServer(create_app(router)) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=30)
        assert client.responses.create(model="second", input="hi", max_output_tokens=2).model == "second"
        assert client.responses.create(input="hi", max_output_tokens=2).model == "first"  # the default
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="third", input="hi", max_output_tokens=2)
