"""Ollama's API on the live server, driven by the official ``ollama`` client with an API key: generate and chat
(streamed and not, checked against the OpenAI routes' answers for the same seed), a JSON-schema answer, a tool call
and its result's follow-up, list / show / ps, the load answer and the unknown-model error."""

from __future__ import annotations

import json

import jsonschema
import ollama
import pytest

from celeris.models.prepack import weight_tensors
from tests.serve.conftest import CONTEXT, MODEL_NAME
from tests.serve.ollama.conftest import AUTH

PROMPT = "def add(a, b):"
SAMPLED = {"temperature": 1.0, "num_predict": 16}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def get_weather(city: str, unit: str) -> str:
    """Current weather of a city.

    Args:
      city: the city's name
      unit: c or f
    """
    return f"21 {unit} in {city}"


def openai_chat(http, messages: list[dict], **body) -> dict:
    response = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, **body})
    assert response.status_code == 200, response.text
    return response.json()


def check_final(chunk, prompt_tokens: int, completion_tokens: int) -> None:
    """A final chunk: done, a done_reason, the counters and durations (nanoseconds) that add up."""
    assert chunk.done is True and chunk.done_reason in ("stop", "length")
    assert chunk.prompt_eval_count == prompt_tokens and chunk.eval_count == completion_tokens
    assert chunk.load_duration == 0 and chunk.prompt_eval_duration > 0 and chunk.eval_duration >= 0
    assert abs(chunk.total_duration - chunk.prompt_eval_duration - chunk.eval_duration) <= 2


def test_generate_is_the_chat_answer_to_the_prompt(oclient, http):
    """Not raw: the prompt is the user turn under the chat template, as the OpenAI chat route renders it."""
    out = oclient.generate(model=MODEL_NAME, prompt=PROMPT, system="Be brief.", options={"seed": 3, **SAMPLED})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    ref = openai_chat(http, messages, seed=3, temperature=1.0, max_tokens=16)
    assert out.model == MODEL_NAME and out.response == ref["choices"][0]["message"]["content"]
    assert out.done_reason == ref["choices"][0]["finish_reason"]
    check_final(out, ref["usage"]["prompt_tokens"], ref["usage"]["completion_tokens"])


def test_raw_generate_and_suffix_are_completions(oclient, http):
    for extra in ({"raw": True}, {"suffix": "\n    return total\n"}):
        out = oclient.generate(model=f"{MODEL_NAME}:latest", prompt=PROMPT, options={"seed": 4, **SAMPLED}, **extra)
        body = {"model": MODEL_NAME, "prompt": PROMPT, "seed": 4, "temperature": 1.0, "max_tokens": 16,
                "suffix": extra.get("suffix")}
        ref = http.post("/v1/completions", json=body).json()
        assert out.model == f"{MODEL_NAME}:latest"
        assert out.response == ref["choices"][0]["text"]
        assert out.eval_count == ref["usage"]["completion_tokens"]


def test_streamed_chunks_reassemble_to_the_answer(oclient):
    whole = oclient.generate(model=MODEL_NAME, prompt=PROMPT, options={"seed": 5, **SAMPLED})
    parts = list(oclient.generate(model=MODEL_NAME, prompt=PROMPT, options={"seed": 5, **SAMPLED}, stream=True))
    assert len(parts) > 2 and all(not p.done for p in parts[:-1]) and parts[-1].response == ""
    assert "".join(p.response for p in parts) == whole.response
    check_final(parts[-1], whole.prompt_eval_count, whole.eval_count)
    messages = [{"role": "user", "content": "Say something."}]
    reply = oclient.chat(model=MODEL_NAME, messages=messages, options={"seed": 6, **SAMPLED})
    chunks = list(oclient.chat(model=MODEL_NAME, messages=messages, options={"seed": 6, **SAMPLED}, stream=True))
    assert all(c.message.role == "assistant" for c in chunks) and chunks[-1].done
    assert "".join(c.message.content for c in chunks) == reply.message.content
    assert chunks[-1].eval_count == reply.eval_count and chunks[-1].done_reason == reply.done_reason


def test_chat_matches_the_openai_route(oclient, http):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A stack class"}]
    out = oclient.chat(model=MODEL_NAME, messages=messages, options={"seed": 7, "top_k": 20, "steps": 8, **SAMPLED})
    ref = openai_chat(http, messages, seed=7, temperature=1.0, max_tokens=16, top_k=20, steps=8)
    assert out.message.content == ref["choices"][0]["message"]["content"]
    check_final(out, ref["usage"]["prompt_tokens"], ref["usage"]["completion_tokens"])


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_format_validates(oclient, stream):
    kwargs = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Who?"}], "format": PERSON,
              "options": {"seed": 2, "temperature": 0.7, "num_predict": 64}}
    out = oclient.chat(**kwargs, stream=stream)
    text = "".join(c.message.content for c in out) if stream else out.message.content
    jsonschema.validate(json.loads(text), PERSON)
    mode = oclient.generate(model=MODEL_NAME, prompt="Who?", format="json", options={"seed": 1, "num_predict": 64})
    assert isinstance(json.loads(mode.response), dict)


@pytest.mark.slow  # a model with a context long enough for the tool definitions (about 4 s)
def test_tool_call_and_its_result(long_server):
    """A call with its arguments as an object (validating against the tool's schema), streamed as one whole chunk
    equal to the non-streamed call; then the result's follow-up answers as the OpenAI route does."""
    import httpx

    oclient = ollama.Client(host=long_server.url, headers=AUTH, timeout=60)
    http = httpx.Client(base_url=long_server.url, headers=AUTH, timeout=60)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = {"model": MODEL_NAME, "messages": messages, "tools": [get_weather],
              "options": {"seed": 5, "temperature": 0.7, "num_predict": 96, "tool_choice": "required"}}
    out = oclient.chat(**kwargs)
    calls = out.message.tool_calls
    assert calls and out.done_reason == "stop" and out.message.content == ""
    schema = ollama._utils.convert_function_to_tool(get_weather).model_dump(exclude_none=True)["function"]
    for call in calls:
        assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
        jsonschema.validate(call.function.arguments, schema["parameters"])
    chunks = list(oclient.chat(**kwargs, stream=True))
    with_calls = [c for c in chunks if c.message.tool_calls]
    assert len(with_calls) == 1 and not with_calls[0].done
    assert [c.function.model_dump() for c in with_calls[0].message.tool_calls] == [c.function.model_dump()
                                                                                 for c in calls]
    history = messages + [out.message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_name": c.function.name, "content": get_weather(**c.function.arguments)}
                for c in calls]
    follow = oclient.chat(model=MODEL_NAME, messages=history, tools=[get_weather],
                          options={"seed": 8, **SAMPLED, "tool_choice": "none"})
    assert isinstance(follow.message.content, str) and not follow.message.tool_calls
    ref_history = messages + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{k}", "type": "function",
         "function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
        for k, c in enumerate(calls)]}]
    ref_history += [{"role": "tool", "tool_call_id": f"call_{k}", "name": c.function.name,
                     "content": get_weather(**c.function.arguments)} for k, c in enumerate(calls)]
    tools = [{"type": "function", "function": schema}]
    ref = openai_chat(http, ref_history, tools=tools, tool_choice="none", seed=8, temperature=1.0, max_tokens=16)
    assert follow.message.content == ref["choices"][0]["message"]["content"]


def test_list_show_and_ps(oclient, serve_llm):
    models = oclient.list().models
    assert [m.model for m in models] == [f"{MODEL_NAME}:latest"]
    size = sum(p.numel() * p.element_size() for p in weight_tensors(serve_llm.model))  # any prepacked weights too
    assert models[0].size == size and models[0].details.family == "celeris" and len(models[0].digest) == 64
    shown = oclient.show(MODEL_NAME)
    assert shown.modelinfo["celeris.context_length"] == CONTEXT == serve_llm.context_length
    assert shown.modelinfo["general.parameter_count"] == sum(p.numel() for p in weight_tensors(serve_llm.model))
    assert set(shown.capabilities) == {"completion", "tools", "insert"}
    assert shown.template == serve_llm.tokenizer.chat_template
    assert "num_predict 16" in shown.parameters.splitlines() and shown.details.format == "safetensors"
    assert oclient.show(f"{MODEL_NAME}:latest").modelinfo == shown.modelinfo
    running = oclient.ps().models
    assert [m.model for m in running] == [f"{MODEL_NAME}:latest"] and running[0].context_length == CONTEXT
    assert running[0].size_vram == 0  # on the CPU


def test_empty_prompt_only_loads(oclient):
    assert oclient.generate(model=MODEL_NAME).done_reason == "load"
    assert oclient.generate(model=MODEL_NAME, keep_alive=0).done_reason == "unload"
    assert oclient.chat(model=MODEL_NAME, messages=[]).done_reason == "load"


def test_unknown_model_is_a_404(oclient):
    for call in (lambda: oclient.chat(model="llama3.2", messages=[{"role": "user", "content": "hi"}]),
                 lambda: oclient.generate(model="llama3.2", prompt="hi", stream=True).__next__(),
                 lambda: oclient.show("llama3.2"), lambda: oclient.generate(model=f"{MODEL_NAME}:7b", prompt="x")):
        with pytest.raises(ollama.ResponseError) as info:
            call()
        assert info.value.status_code == 404 and "not found" in info.value.error
        assert f"'{MODEL_NAME}:latest'" in info.value.error


def test_the_api_key_guards_api(ollama_server):
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=ollama_server.url).list()
    assert info.value.status_code == 401
    assert info.value.error == "invalid or missing API key; send 'Authorization: Bearer <key>'"

