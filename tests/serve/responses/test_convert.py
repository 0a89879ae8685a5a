"""Responses -> chat: input items as chat messages (the SDK's mapping), the chat request body, and the chat
path's refusals renamed to the Responses fields."""

from __future__ import annotations

import json

import pytest

from celeris.serve.protocol import APIError, ChatCompletionRequest, parse_request
from celeris.serve.responses.convert import chat_body, chat_messages, input_items, responses_error
from celeris.serve.responses.routes import parse_responses_request

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
     "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}',
     "id": "fc_1", "status": "completed"},
    {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be "},
                                                          {"type": "input_text", "text": "brief"}]},
]


def request(**fields):
    return parse_responses_request(json.dumps({"input": "hi", **fields}))


def test_items_become_the_chat_messages_the_sdk_would_send():
    r = request(input=HISTORY, instructions="Answer with the weather.")
    assert chat_messages(r.instructions, input_items(r)) == [
        {"role": "system", "content": "Answer with the weather."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "developer", "content": "be brief"},
    ]


def test_a_call_without_an_assistant_message_before_it_gets_its_own():
    r = request(input=[HISTORY[0], HISTORY[3]])
    messages = chat_messages(None, input_items(r))
    assert messages[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}


def test_the_chat_body_is_a_valid_chat_request_with_the_same_settings():
    tool = {"type": "function", "name": "get_weather", "description": "d", "strict": True,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    r = request(tools=[tool], tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
                max_output_tokens=7, temperature=0.5, top_p=0.9, seed=3, steps=4, stream=True)
    chat = parse_request(ChatCompletionRequest, json.dumps(chat_body(r, input_items(r))))
    assert chat.tools[0].function.model_dump(exclude_none=True) == {k: v for k, v in tool.items() if k != "type"}
    assert chat.tool_choice.function.name == "get_weather" and chat.parallel_tool_calls is False
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.seed, chat.steps) == (7, 0.5, 0.9, 3, 4)
    assert chat.stream and chat.stream_options.include_usage


@pytest.mark.parametrize(("fmt", "expected"), [
    ({"type": "text"}, {"type": "text"}),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True}}),
])
def test_text_format_becomes_response_format(fmt, expected):
    r = request(text={"format": fmt})
    assert chat_body(r, input_items(r))["response_format"] == expected


def test_a_json_schema_format_without_its_schema_is_400_naming_it():
    r = request(text={"format": {"type": "json_schema", "name": "p"}})
    with pytest.raises(APIError) as info:
        chat_body(r, input_items(r))
    assert info.value.status_code == 400 and info.value.param == "text.format.schema"


@pytest.mark.parametrize(("param", "message", "renamed_param", "renamed_message"), [
    ("response_format", "response_format cannot be combined", "text.format", "text.format cannot be combined"),
    ("messages", "the messages (rendered with the chat template) are too long", "input",
     "the input (rendered with the chat template) are too long"),
    ("max_completion_tokens", "max_tokens must be >= 1", "max_output_tokens", "max_output_tokens must be >= 1"),
    ("tools[2].function.parameters", "bad schema", "tools[2].parameters", "bad schema"),
    ("steps", "steps must be >= 1", "steps", "steps must be >= 1"),
])
def test_chat_refusals_name_the_responses_fields(param, message, renamed_param, renamed_message):
    exc = responses_error(APIError(400, message, param=param, code="invalid_value"))
    assert (exc.status_code, exc.param, exc.message, exc.code) == (400, renamed_param, renamed_message,
                                                                  "invalid_value")
