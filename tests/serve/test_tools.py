"""Tool definitions and history as the serving layer reads them (``celeris.serve.tools``): parameters whose
``$ref``s point inside themselves, non-object parameters, and the rules for history tool calls (issue 28 items 1
and 2). No model runs here: the grammar a request is decoded under is checked with llguidance directly."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel, Field

from celeris.serve.errors import APIError, parse_request
from celeris.serve.protocol import ChatCompletionRequest
from celeris.serve.tools import chat_grammar
from celeris.structured.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Constraint, grammar_tokenizer
from celeris.tokenizer import Tokenizer
from tests.conftest import REPO_ROOT

USER = [{"role": "user", "content": "Where am I?"}]
EMBEDDED = REPO_ROOT / "celeris" / "checkpoints" / "celeris-code-6m"


class Point(BaseModel):
    x: int = Field(ge=0, le=99)
    y: int = Field(ge=0, le=99)


class Place(BaseModel):
    at: Point  # a nested model: pydantic writes {"$defs": {"Point": ...}, ... {"$ref": "#/$defs/Point"}}
    label: str = Field(max_length=4)


PLACE = {"type": "function", "function": {"name": "go", "parameters": Place.model_json_schema()}}


def request(**body) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, json.dumps({"messages": USER, **body}))


def test_pydantic_nested_parameters_compile_for_every_tool_choice():
    """auto, required and a named function all get a grammar (before: 400 "Pointer '/$defs/Point' does not
    exist"), and each takes exactly the calls whose arguments validate against the nested schema."""
    assert "$defs" in PLACE["function"]["parameters"]
    named = {"type": "function", "function": {"name": "go"}}
    grammars = {str(choice): chat_grammar(request(tools=[PLACE], tool_choice=choice))[0]
                for choice in ("auto", "required", named)}
    schema = PLACE["function"]["parameters"]
    calls = [({"at": {"x": 1, "y": 2}, "label": "home"}, True), ({"at": {"x": 1}, "label": "home"}, False),
             ({"at": {"x": 1, "y": 2}, "label": "too long"}, False), ({"label": "home"}, False)]
    tok = Tokenizer(EMBEDDED)
    matchers = {mode: Constraint(grammar, grammar_tokenizer(tok)).matcher for mode, grammar in grammars.items()}
    for arguments, valid in calls:
        assert jsonschema.Draft202012Validator(schema).is_valid(arguments) is valid  # the reference validator
        body = json.dumps({"name": "go", "arguments": arguments}, separators=(",", ":"))
        ids = tok.encode(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE)
        for mode, matcher in matchers.items():
            m = matcher.deep_copy()
            assert (all(m.consume_token(t) for t in ids) and m.is_accepting()) is valid, (mode, arguments)


@pytest.mark.parametrize("parameters", [{"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                                        {"properties": {"a": {"type": "string"}}}])
def test_non_object_parameters_are_400_naming_the_field(parameters):
    tools = [PLACE, {"type": "function", "function": {"name": "f", "parameters": parameters}}]
    for choice in ("required", "none"):
        with pytest.raises(APIError) as info:
            chat_grammar(request(tools=tools, tool_choice=choice))
        assert info.value.status_code == 400 and info.value.param == "tools[1].function.parameters"
        assert 'type "object"' in info.value.message
