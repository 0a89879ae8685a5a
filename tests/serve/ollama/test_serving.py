"""The translation of Ollama's requests into the OpenAI serving layer's, without a model: options onto sampling
fields, ``format`` onto ``response_format``, messages (tool calls and their results paired by id) onto OpenAI's,
and the serving layer's field names written back as Ollama's in error messages."""

from __future__ import annotations

import json

import pytest

from celeris.serve.errors import APIError, parse_request
from celeris.serve.ollama.protocol import ChatRequest, GenerateRequest, Options
from celeris.serve.ollama.serving import (
    chat_messages,
    chat_request,
    generate_request,
    response_format,
    sampling_body,
    with_ollama_names,
)
from celeris.serve.protocol import ChatCompletionRequest, CompletionRequest


def options(**fields) -> Options:
    return parse_request(Options, json.dumps(fields))


def test_options_map_onto_the_sampling_fields():
    body = sampling_body(options(num_predict=12, temperature=0.5, top_p=0.9, top_k=40, min_p=0.1, seed=3,
                                 stop=["\n\n"], repeat_penalty=1.1, num_ctx=64, steps=6, remasking="random",
                                 num_gpu=1, num_thread=2, mirostat=0, penalize_newline=True, frequency_penalty=0.5,
                                 presence_penalty=0.25), 128)
    assert body == {"max_tokens": 12, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.1, "seed": 3,
                    "stop": ["\n\n"], "repetition_penalty": 1.1, "steps": 6, "remasking": "random",
                    "frequency_penalty": 0.5, "presence_penalty": 0.25}
    assert sampling_body(options(num_predict=-1, stop="END"), 128) == {"stop": ["END"]}
    assert sampling_body(options(num_predict=-2), 128) == {} and sampling_body(None, 128) == {}


@pytest.mark.parametrize(("fields", "param"), [({"num_predict": 0}, "options.num_predict"),
                                               ({"num_predict": -3}, "options.num_predict"),
                                               ({"num_ctx": 129}, "options.num_ctx"), ({"num_ctx": 0}, "options.num_ctx")])
def test_options_out_of_range_are_400s(fields, param):
    with pytest.raises(APIError) as info:
        sampling_body(options(**fields), 128)
    assert info.value.status_code == 400 and info.value.param == param


def test_options_refuse_what_celeris_does_not_implement_and_the_openai_name():
    assert options(mirostat=1, tfs_z=0.5, typical_p=1, repeat_last_n=64).unsupported() == [
        "options.mirostat", "options.tfs_z", "options.repeat_last_n"]
    assert options(mirostat=0, tfs_z=1.0, presence_penalty=0).unsupported() == []
    with pytest.raises(APIError, match="unrecognized request argument supplied: repetition_penalty"):
        options(repetition_penalty=1.2)  # Ollama's name is repeat_penalty


def test_format_is_a_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert response_format(None) is None and response_format("") is None
    assert response_format("json") == {"type": "json_object"}
    assert response_format(schema) == {"type": "json_schema", "json_schema": {"name": "format", "schema": schema}}


def test_tool_calls_and_results_pair_by_name_then_order():
    messages = parse_request(ChatRequest, json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "weather and time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "time", "arguments": {"zone": 1}}},
            {"function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "weather", "content": "sunny"},
        {"role": "tool", "content": "noon"},
        {"role": "assistant", "tool_calls": [{"id": "x7", "function": {"name": "time", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "x7", "content": "one"}]})).messages
    out = chat_messages(messages)
    assert [c["id"] for c in out[1]["tool_calls"]] == ["call_0", "call_1"]
    assert json.loads(out[1]["tool_calls"][1]["function"]["arguments"]) == {"city": "Paris"}
    assert [(m["tool_call_id"], m.get("name")) for m in out if m["role"] == "tool"] == [
        ("call_1", "weather"), ("call_0", None), ("x7", None)]
    request = ChatCompletionRequest.model_validate({"messages": out})  # the OpenAI side takes them as they are
    assert request.messages[1].tool_calls[0].function.name == "time"


def test_generate_becomes_a_chat_turn_or_a_completion():
    def gen(**fields) -> GenerateRequest:
        return parse_request(GenerateRequest, json.dumps({"model": "m", "prompt": "p", **fields}))

    chat = generate_request(gen(system="s", options={"num_predict": 4}), "m", 128)
    assert isinstance(chat, ChatCompletionRequest) and chat.stream and chat.stream_options.include_usage
    assert [(m.role, m.content) for m in chat.messages] == [("system", "s"), ("user", "p")] and chat.max_tokens == 4
    raw = generate_request(gen(raw=True, format="json"), "m", 128)
    assert isinstance(raw, CompletionRequest) and raw.prompt == "p" and raw.suffix is None
    assert raw.response_format.type == "json_object"
    fill = generate_request(gen(suffix="end"), "m", 128)
    assert isinstance(fill, CompletionRequest) and fill.suffix == "end"
    tools = parse_request(ChatRequest, json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                   "tools": [{"function": {"name": "f"}}],
                                                   "options": {"tool_choice": "f"}}))
    assert chat_request(tools, "m", 128).tool_choice.function.name == "f"


def test_messages_name_the_ollama_fields():
    exc = with_ollama_names(APIError(400, "the prompt (9 tokens) plus max_tokens (200) need 209 tokens",
                                     param="max_tokens", code="context_length_exceeded"))
    assert exc.message == "the prompt (9 tokens) plus options.num_predict (200) need 209 tokens"
    assert exc.param == "options.num_predict" and exc.code == "context_length_exceeded"
    assert with_ollama_names(APIError(400, "'response_format.json_schema.schema' is bad")).message == "'format' is bad"


def openai_chunks(deltas: list[dict], finish_reason: str) -> list:
    """An OpenAI chat stream of one choice: the role chunk, ``deltas``, the finish, the usage chunk."""
    from celeris.serve.protocol import ChatCompletionChunk

    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> ChatCompletionChunk:
        choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]
        return ChatCompletionChunk.model_validate({"id": "c", "created": 0, "model": "m", "choices": choices,
                                                   "usage": usage})

    return [chunk({"role": "assistant", "content": ""}), *map(chunk, deltas), chunk({}, finish_reason),
            chunk({}, usage={"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12})]


async def collect(chunks: list, chat: bool = True) -> list:
    from celeris.serve.ollama.serving import ollama_stream

    async def stream():
        for c in chunks:
            yield c

    return [c async for c in ollama_stream(stream(), 0.0, "m:latest", chat)]


def call_deltas(name: str, pieces: list[str]) -> list[dict]:
    first = {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                             "function": {"name": name, "arguments": ""}}]}
    return [first, *({"tool_calls": [{"index": 0, "function": {"arguments": p}}]} for p in pieces)]


def test_a_streamed_call_arrives_whole_in_one_chunk():
    import asyncio

    out = asyncio.run(collect(openai_chunks(call_deltas("f", ['{"c":', ' [1, 2]', "}"]), "tool_calls")))
    assert [c.done for c in out] == [False, True]
    call = out[0].message.tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == ("call_a", "f", {"c": [1, 2]})
    final = out[-1]
    assert final.done_reason == "stop" and final.prompt_eval_count == 7 and final.eval_count == 5
    assert final.model == "m:latest" and final.message.content == "" and final.created_at.endswith("Z")


def test_a_call_cut_by_the_budget_is_not_a_call_and_text_streams_as_it_comes():
    import asyncio

    out = asyncio.run(collect(openai_chunks(call_deltas("f", ['{"c": [1,']), "length")))
    assert [(c.done, c.message.tool_calls, c.done_reason) for c in out] == [(True, None, "length")]
    text = asyncio.run(collect(openai_chunks([{"content": "ab"}, {"content": "c"}], "stop"), chat=False))
    assert [(c.response, c.done) for c in text] == [("ab", False), ("c", False), ("", True)]
