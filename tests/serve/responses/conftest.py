"""A live server on the serve tests' tiny model with a 2048-token context (room for tool definitions), built once
for every Responses test module, driven by the official ``openai`` client."""

from __future__ import annotations

import openai
import pytest

from celeris.llm import LLM
from celeris.serve.app import BackgroundServer, create_app
from tests.serve.conftest import make_serving


@pytest.fixture(scope="session")
def responses_llm(long_llm) -> LLM:
    """The serve tests' 2048-token tiny model (tests/serve/conftest.py ``long_llm``)."""
    return long_llm


@pytest.fixture(scope="module")
def rserver(responses_llm):
    serving = make_serving(responses_llm)
    with BackgroundServer(create_app(serving)) as srv:
        srv.serving = serving
        yield srv


@pytest.fixture(scope="module")
def rclient(rserver):
    return openai.OpenAI(base_url=f"{rserver.url}/v1", api_key="unused", max_retries=0, timeout=60)
