"""Fixtures for the server tests: a tiny checkpoint built in-process and live servers on loopback.

The checkpoint is this package's own (a context window of 128 tokens leaves room for chat
prompts), so these tests do not depend on the shared fixtures' sizes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from celeris.llm import LLM
from celeris.serve.app import BackgroundServer, create_app
from celeris.serve.serving import OpenAIServing
from tests.conftest import TINY_LLM, build_tiny_checkpoint

MODEL_NAME = "tiny-serve"
CONTEXT = 128
GENERATION_CONFIG = {"max_tokens": 16, "steps": 8, "block_length": 8, "temperature": 0.0, "top_p": 1.0,
                     "remasking": "low_confidence", "cfg_scale": 0.0}
TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    for name in sorted(os.listdir('.')):\n"
    "        print(name, file=sys.stdout)\n    return 0\n",
    "# user: write a function\n# assistant:\ndef add(a, b):\n    return a + b\n",
]


def build_checkpoint(folder: Path) -> Path:
    return build_tiny_checkpoint(folder, TEXTS, MODEL_NAME, CONTEXT, GENERATION_CONFIG)


@pytest.fixture(scope="session")
def serve_checkpoint(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="session")
def serve_llm(serve_checkpoint) -> LLM:
    return LLM(serve_checkpoint, **TINY_LLM)


@pytest.fixture(scope="session")
def long_llm(tmp_path_factory) -> LLM:
    """The serve tests' tiny model with a 2048-token context (room for tool definitions in the prompt), shared by
    the structured-output, agents and Responses tests (each builds its own serving and engine on it)."""
    folder = tmp_path_factory.mktemp("long")
    return LLM(build_tiny_checkpoint(folder, TEXTS, MODEL_NAME, 2048, GENERATION_CONFIG), **TINY_LLM)


def make_serving(llm: LLM, max_num_seqs: int = 4, max_waiting: int = 8, request_timeout: float = 30.0,
                 step_delay: float = 0.0) -> OpenAIServing:
    """A serving layer on the shared LLM with its own engine; ``step_delay`` slows every step down
    (seconds) so tests can act while a request is in flight."""
    from celeris.config import EngineConfig

    serving = OpenAIServing(llm, served_model_name=MODEL_NAME, request_timeout=request_timeout,
                            engine_config=EngineConfig(max_num_seqs=max_num_seqs, max_waiting=max_waiting))
    if step_delay:
        engine = serving.async_engine.engine
        real_step = engine.step

        def slow_step():
            time.sleep(step_delay)
            return real_step()

        engine.step = slow_step
    return serving


@pytest.fixture(scope="module")
def server(serve_llm):
    """A live server: 4 running + 8 waiting requests, no API key."""
    serving = make_serving(serve_llm)
    with BackgroundServer(create_app(serving)) as srv:
        srv.serving = serving
        yield srv


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def wait_for_health(proc, url: str, timeout_s: float = 90) -> None:
    """Poll ``url``/health until it answers 200; fail with the server's output if it exits or times out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "celeris serve did not come up"
        time.sleep(0.2)
