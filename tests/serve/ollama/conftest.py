"""A live server with an API key for the Ollama API tests, on the serve tests' tiny model (context 128), driven by the
official ``ollama`` client (and ``httpx`` for the OpenAI routes the answers are compared with); ``long_server``: the
same model with a context long enough for tool definitions in the prompt (slow tier)."""

from __future__ import annotations

import httpx
import pytest

from celeris.llm import LLM
from celeris.serve.app import BackgroundServer, create_app
from tests.conftest import TINY_LLM, build_tiny_checkpoint
from tests.serve.conftest import GENERATION_CONFIG, MODEL_NAME, TEXTS, make_serving

API_KEY = "ollama-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG_CONTEXT = 2048


@pytest.fixture(scope="package")
def ollama_server(serve_llm):
    serving = make_serving(serve_llm)
    with BackgroundServer(create_app(serving, api_key=API_KEY)) as srv:
        srv.serving = serving
        yield srv


@pytest.fixture(scope="package")
def long_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ollama")
    llm = LLM(build_tiny_checkpoint(folder, TEXTS, MODEL_NAME, LONG_CONTEXT, GENERATION_CONFIG), **TINY_LLM)
    serving = make_serving(llm)
    with BackgroundServer(create_app(serving, api_key=API_KEY)) as srv:
        yield srv


@pytest.fixture
def oclient(ollama_server):
    import ollama

    return ollama.Client(host=ollama_server.url, headers=AUTH, timeout=60)


@pytest.fixture
def http(ollama_server):
    with httpx.Client(base_url=ollama_server.url, headers=AUTH, timeout=60) as client:
        yield client
