"""The Responses request: what is honoured, what is accepted and ignored, and what is refused (400 naming the
field, with a reason), before anything reaches the engine."""

from __future__ import annotations

import json

import pytest

from celeris.serve.protocol import APIError
from celeris.serve.responses.routes import parse_responses_request


def parse(**fields):
    return parse_responses_request(json.dumps({"model": "m", "input": "hi", **fields}))


def refused(**fields) -> APIError:
    with pytest.raises(APIError) as info:
        parse(**fields)
    assert info.value.status_code == 400
    return info.value


def test_the_fields_the_sdk_sends_at_neutral_values_are_accepted():
    r = parse(include=[], truncation="disabled", reasoning=None, prompt_cache_key="k", service_tier="auto",
              user="u", background=False, conversation=None, store=False, metadata={"a": "b"})
    assert r.store is False and r.metadata == {"a": "b"}
    assert parse().store is None and parse(store=None).store is None  # true, OpenAI's default


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "file_search", "vector_store_ids": []}]},
     "tools[1].type"),
    ({"tools": [{"type": "computer_use_preview"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
])
def test_unsupported_features_are_refused_with_a_reason(fields, param):
    exc = refused(**fields)
    assert exc.param == param and exc.code == "unsupported_parameter" and "not" in exc.message


@pytest.mark.parametrize(("fields", "param"), [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tool_calls": 1}, "max_tool_calls"),
    ({"prompt": {"id": "p"}}, "prompt"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "not json"}]},
     "input[0].arguments"),
    ({"text": {"format": {"type": "json_schema", "name": "p", "schema": {}, "verbosity": "low"}}},
     "text.format.verbosity"),
])
def test_other_fields_and_bad_values_are_400_naming_the_field(fields, param):
    assert refused(**fields).param == param
