"""What the model routes say about several served models (``--also-serve``) and an autoregressive one: names with
``:latest``, capabilities (no ``insert`` where the model cannot infill, and ``suffix`` a 400 saying why), each
request answered by the model it names."""

from __future__ import annotations

import httpx
import ollama
import pytest

from celeris.config import EngineConfig
from celeris.llm import LLM
from celeris.serve.app import BackgroundServer, create_app
from celeris.serve.metrics import ServerMetrics
from celeris.serve.models_router import ModelRouter
from celeris.serve.ollama import models
from celeris.serve.serving import OpenAIServing
from celeris.train.loop import AR_GENERATION
from tests.conftest import build_tiny_checkpoint
from tests.serve.conftest import CONTEXT, TEXTS


@pytest.fixture(scope="module")
def two_models(serve_llm, tmp_path_factory):
    """The serve tests' diffusion model as "tiny-a" and an autoregressive twin as "twin:small"."""
    folder = build_tiny_checkpoint(tmp_path_factory.mktemp("twin"), TEXTS, "twin", CONTEXT,
                                   {**AR_GENERATION, "max_tokens": 8}, is_causal=True)
    shared = ServerMetrics()
    servings = [OpenAIServing(llm, served_model_name=name, metrics=shared,
                              engine_config=EngineConfig(max_num_seqs=2, max_waiting=4))
                for llm, name in ((serve_llm, "tiny-a"), (LLM(folder, device="cpu"), "twin:small"))]
    with BackgroundServer(create_app(ModelRouter(servings))) as srv:
        yield srv


def test_every_served_model_is_listed_and_answers_by_name(two_models):
    client = ollama.Client(host=two_models.url, timeout=30)
    assert [m.model for m in client.list().models] == ["tiny-a:latest", "twin:small"]
    assert [m.model for m in client.ps().models] == ["tiny-a:latest", "twin:small"]
    for name in ("tiny-a", "tiny-a:latest", "twin:small"):
        out = client.generate(model=name, prompt="def f(x):", raw=True, options={"num_predict": 4})
        assert out.model == name and out.done and out.eval_count <= 4
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model="twin", prompt="x")  # the tag is part of its name
    assert info.value.status_code == 404 and "'tiny-a:latest', 'twin:small'" in info.value.error


def test_an_autoregressive_model_cannot_infill(two_models):
    client = ollama.Client(host=two_models.url, timeout=30)
    assert "insert" in client.show("tiny-a").capabilities
    assert client.show("twin:small").capabilities == ["completion", "tools"]
    response = httpx.post(f"{two_models.url}/api/generate", timeout=30,
                          json={"model": "twin:small", "prompt": "def f(x):", "suffix": "\n", "stream": False})
    assert response.status_code == 400
    assert response.json() == {"error": "suffix (infilling) needs a masked-diffusion model; this one is "
                                        "autoregressive (causal)"}


def test_names_and_sizes():
    assert models.tagged("m") == "m:latest" and models.tagged("m:7b") == "m:7b"
    assert [models.human_count(n) for n in (6_100_000, 134_515_008, 7_615_616_512, 52_000)] == [
        "6M", "135M", "7.6B", "52K"]
