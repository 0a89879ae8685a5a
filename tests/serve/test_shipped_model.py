"""The official openai client, unchanged, against a live server on the shipped model: completions, chat,
streaming (deltas == the non-streamed text for the same seed), models."""

from __future__ import annotations

import openai
import pytest

from celeris.serve.app import BackgroundServer, create_app
from celeris.serve.serving import OpenAIServing


@pytest.fixture(scope="module")
def client():
    serving = OpenAIServing.from_model("celeris-code-6m-hybrid", device="cpu", max_num_seqs=4, max_waiting=8)
    with BackgroundServer(create_app(serving)) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60), serving


def test_openai_client_on_the_shipped_model(client):
    client, serving = client
    name = client.models.list().data[0].id
    assert name == serving.model_name == "celeris-code-6m-hybrid"
    done = client.completions.create(model=name, prompt="def fibonacci(n):", max_tokens=12, seed=0)
    assert done.choices[0].text and done.usage.completion_tokens == 12 and done.choices[0].finish_reason == "length"
    pieces = client.completions.create(model=name, prompt="def fibonacci(n):", max_tokens=12, seed=0, stream=True)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == done.choices[0].text
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "a stack class"}],
                                          max_tokens=8, extra_body={"cache": "delayed"})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1


def test_structured_output_on_the_default_hybrid_model(client):
    """The default's `verified` decoding runs under a grammar (drafts checked against the grammar-masked head), so
    structured output on the shipped model keeps its speed; its answer is next-token decoding's (same greedy
    text)."""
    import json

    import jsonschema

    client, serving = client
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Ada, 36"}]
    r = client.chat.completions.create(model=serving.model_name, messages=messages, max_tokens=64, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.model_extra is not None and r.choices[0].model_extra["celeris"]["decoding"] == "verified"
    fixed = client.chat.completions.create(model=serving.model_name, messages=messages, max_tokens=64,
                                           response_format=fmt, extra_body={"decoding": "fixed"})
    assert fixed.choices[0].message.content == r.choices[0].message.content
