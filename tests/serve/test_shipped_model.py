"""The official openai client, unchanged, against a live server on the shipped model: completions, chat,
streaming (deltas == the non-streamed text for the same seed), models."""

from __future__ import annotations

import openai
import pytest

from celeris.serve.app import BackgroundServer, create_app
from celeris.serve.serving import OpenAIServing


@pytest.fixture(scope="module")
def client():
    serving = OpenAIServing.from_model(None, device="cpu", max_num_seqs=4, max_waiting=8)
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
