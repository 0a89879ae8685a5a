"""Fixtures for batch-job tests: a tiny checkpoint built in-process (as in tests/serve), serving
layers on it, fake servings that script their answers, and helpers to write and read JSONL files."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from celeris.config import EngineConfig
from celeris.llm import LLM
from celeris.serve.serving import OpenAIServing
from tests.conftest import build_tiny_checkpoint

MODEL_NAME = "tiny-batch"
CONTEXT = 128
GENERATION_CONFIG = {"max_tokens": 8, "steps": 8, "block_length": 8, "temperature": 0.0, "top_p": 1.0,
                     "remasking": "low_confidence", "cfg_scale": 0.0}
TEXTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun.\n",
    "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning.\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Compose an engaging travel blog post about a recent trip to Hawaii.\n",
]


def pytest_configure(config):
    config.addinivalue_line("markers", "ray: starts a local Ray instance with two actors (~30-60 s on two busy cores)")


def build_checkpoint(folder: Path) -> Path:
    return build_tiny_checkpoint(folder, TEXTS, MODEL_NAME, CONTEXT, GENERATION_CONFIG)


@pytest.fixture(scope="session")
def batch_checkpoint(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("batch"))


@pytest.fixture(scope="session")
def batch_llm(batch_checkpoint) -> LLM:
    return LLM(batch_checkpoint, device="cpu")


class CountingServing(OpenAIServing):
    """A real serving layer that also records which request bodies it was asked to run."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[dict] = []

    async def respond(self, endpoint, body):
        self.calls.append(body)
        return await super().respond(endpoint, body)


@pytest.fixture
def make_serving(batch_llm):
    """Factory of factories: ``make_serving()`` -> a fresh real serving (own engine, shared model);
    every serving built is kept in ``make_serving.built``."""
    built: list[CountingServing] = []

    def factory(max_num_seqs: int = 4) -> CountingServing:
        serving = CountingServing(batch_llm, served_model_name=MODEL_NAME, request_timeout=60.0,
                                  engine_config=EngineConfig(max_num_seqs=max_num_seqs, max_waiting=64))
        built.append(serving)
        return serving

    factory.built = built
    return factory


class FakeServing:
    """Scripted stand-in for OpenAIServing: ``answers(body) -> (status, body)``; tracks concurrency."""

    def __init__(self, answer=None, delay: float = 0.0) -> None:
        self.answer = answer or (lambda body: (200, completion_body(f"echo: {body.get('prompt')}")))
        self.delay = delay
        self.calls: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.started = self.stopped = False

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.stopped = True

    async def respond(self, endpoint: str, body: dict) -> tuple[int, dict]:
        self.calls.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            return self.answer(body)
        finally:
            self.in_flight -= 1


def completion_body(text: str, finish_reason: str = "length", completion_tokens: int = 8) -> dict:
    return {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": MODEL_NAME,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": 3, "completion_tokens": completion_tokens, "total_tokens": 3 + completion_tokens}}


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows: dicts (dumped as JSON) or str (written as they are, e.g. a malformed line)."""
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def by_id(records: list[dict]) -> dict:
    out = {}
    for r in records:
        key = r["custom_id"] if r["custom_id"] is not None else f"line{r['line']}"
        assert key not in out, f"id {key} recorded twice"
        out[key] = r
    return out


def answer_text(record: dict) -> str:
    choice = record["response"]["body"]["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]
