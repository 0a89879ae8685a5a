"""A live server on the serve tests' tiny model with a 2048-token context (room for tool definitions), built once
for every Responses test module, driven by the official ``openai`` client."""

from __future__ import annotations

import openai
import pytest

from celeris.llm import LLM
from celeris.serve.app import BackgroundServer, create_app
from tests.conftest import TINY_LLM, build_tiny_checkpoint
from tests.serve.conftest import GENERATION_CONFIG, MODEL_NAME, TEXTS, make_serving


@pytest.fixture(scope="session")
def responses_llm(tmp_path_factory) -> LLM:
    folder = tmp_path_factory.mktemp("responses")
    return LLM(build_tiny_checkpoint(folder, TEXTS, MODEL_NAME, 2048, GENERATION_CONFIG), **TINY_LLM)


@pytest.fixture(scope="module")
def rserver(responses_llm):
    serving = make_serving(responses_llm)
    with BackgroundServer(create_app(serving)) as srv:
        srv.serving = serving
        yield srv


@pytest.fixture(scope="module")
def rclient(rserver):
    return openai.OpenAI(base_url=f"{rserver.url}/v1", api_key="unused", max_retries=0, timeout=60)
