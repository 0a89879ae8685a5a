"""With engine replicas (``celeris serve --num-replicas``: the app in the ingress, the engine behind a
``RemoteEngine``), the store lives in the ingress: a response is retrieved and continued there, and its answer
is the one a local engine gives."""

from __future__ import annotations

import openai

from celeris.serve.app import BackgroundServer, create_app
from celeris.serve.remote import RemoteEngine
from celeris.serve.serving import OpenAIServing
from tests.serve.conftest import MODEL_NAME, make_serving
from tests.serve.test_remote import FakeReplicas


def test_the_store_lives_in_the_ingress(responses_llm):
    local = make_serving(responses_llm)
    local.start()
    try:
        ingress = OpenAIServing(responses_llm, async_engine=RemoteEngine(FakeReplicas(local), max_in_flight=12),
                                served_model_name=MODEL_NAME)
        fields = {"model": MODEL_NAME, "max_output_tokens": 8, "temperature": 1.0, "extra_body": {"seed": 2}}
        with BackgroundServer(create_app(ingress)) as srv:
            client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=30)
            r1 = client.responses.create(input="Hello", **fields)
            assert client.responses.retrieve(r1.id).output_text == r1.output_text
            r2 = client.responses.create(input="More", previous_response_id=r1.id, **fields)
        with BackgroundServer(create_app(make_serving(responses_llm))) as srv:  # the same turns, one local engine
            client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=30)
            assert client.responses.create(input="Hello", **fields).output_text == r1.output_text
            history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": r1.output_text},
                       {"role": "user", "content": "More"}]
            assert client.responses.create(input=history, **fields).output_text == r2.output_text
    finally:
        local.stop()
