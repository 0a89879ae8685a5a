"""Structured output and tool calls through the live server and the official ``openai`` client: ``.parse()``
with pydantic models, json_object on completions, a two-turn tool loop, streamed tool-call deltas, and the 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from celeris.llm import LLM
from celeris.serve.app import BackgroundServer, create_app
from tests.conftest import build_tiny_checkpoint
from tests.serve.conftest import GENERATION_CONFIG, MODEL_NAME, TEXTS, make_serving
from tests.structured.schemas import SCHEMAS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                "maximum": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Address(BaseModel):
    city: str = Field(max_length=6)
    zip_code: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    address: Address  # a nested model: .parse() sends it as $defs / $ref


@pytest.fixture(scope="module")
def sclient(long_llm):
    serving = make_serving(long_llm)
    with BackgroundServer(create_app(serving)) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_parse_returns_a_pydantic_object(sclient):
    for seed in range(3):
        completion = sclient.chat.completions.parse(model=MODEL_NAME, messages=USER, response_format=Person,
                                                    max_tokens=96, temperature=0.7, seed=seed)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(sclient, name):
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    out = sclient.chat.completions.create(model=MODEL_NAME, messages=USER, response_format=fmt, max_tokens=96,
                                          temperature=0.7, seed=11, n=2)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_object_on_completions_and_chat(sclient):
    out = sclient.completions.create(model=MODEL_NAME, prompt="def f(x):", max_tokens=64, temperature=0.7, seed=1,
                                     extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].text), dict)
    chat = sclient.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=64, seed=2,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(chat.choices[0].message.content), dict)


def test_two_turn_tool_loop(sclient):
    tools = [WEATHER, TIME]
    first = sclient.chat.completions.create(model=MODEL_NAME, messages=USER, tools=tools, tool_choice="required",
                                            max_tokens=96, temperature=0.7, seed=5)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        spec = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), spec)
    messages = USER + [choice.message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": c.id, "content": '{"temp": 21}'} for c in choice.message.tool_calls]
    second = sclient.chat.completions.create(model=MODEL_NAME, messages=messages, tools=tools, tool_choice="none",
                                             max_tokens=16)
    assert second.choices[0].message.tool_calls is None
    assert isinstance(second.choices[0].message.content, str)
    assert second.choices[0].finish_reason in ("stop", "length")


def test_named_tool_choice_and_single_call(sclient):
    out = sclient.chat.completions.create(
        model=MODEL_NAME, messages=USER, tools=[WEATHER, TIME], max_tokens=96, temperature=0.7, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    calls = out.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    assert out.choices[0].finish_reason == "tool_calls"


def test_streamed_tool_call_deltas_reassemble_to_the_call(sclient):
    kwargs = {"model": MODEL_NAME, "messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required",
              "max_tokens": 96, "temperature": 0.7, "seed": 9}
    full = sclient.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    pieces = 0
    for chunk in sclient.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                pieces += 1
                assert d.index is not None
                if d.index not in calls:
                    assert d.id is not None and d.function.name is not None  # the first chunk of a call
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.function.name, c.function.arguments)
                                                                      for c in full]
    assert pieces > 2 * len(calls)  # the arguments arrive in pieces, as they are decoded


def test_call_streamer_pieces_add_up_to_the_parsed_calls():
    from celeris.serve.tools import CallStreamer, parse_tool_calls

    text = ('<tool_call>{"name":"get_weather","arguments":{"city":"P}a\\"r","unit":"c"}}</tool_call>\n'
            '<tool_call>{"name":"get_time","arguments":{"zone":-3}}</tool_call>')
    functions = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    parsed = parse_tool_calls(text, functions)
    for size in (1, 3, 7, len(text)):
        streamer = CallStreamer()
        deltas = [d for i in range(0, len(text), size) for d in streamer.push(text[i:i + size])]
        assert [d.id for d in deltas if d.id] == [c.id for c in streamer.calls]
        assert [(c.function.name, c.function.arguments) for c in streamer.calls] == [
            (c.function.name, c.function.arguments) for c in parsed]
        assert all(d.index in (0, 1) for d in deltas)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                                         "format": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "absent"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"response_format": {"type": "json_object"}, "decoding": "verified"}, "decoding"),
    ({"messages": USER + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_structured_requests_are_400_naming_the_field(sclient, body, param):
    extra = {k: body[k] for k in ("decoding",) if k in body}  # Celeris extensions
    body = {k: v for k, v in body.items() if k not in extra}
    with pytest.raises(openai.BadRequestError) as info:
        sclient.chat.completions.create(**{"model": MODEL_NAME, "messages": USER, "max_tokens": 8, **body},
                                        extra_body=extra)
    assert info.value.body["param"] == param


def test_fields_that_do_not_change_the_output_are_accepted(sclient):
    out = sclient.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=4, store=False,
                                          metadata={"k": "v"}, service_tier="auto")
    assert out.choices[0].message.content is not None


def test_auto_tool_choice_answers_text_or_valid_calls(sclient):
    """tool_choice "auto" is decoded under "calls | text without the call tag": every answer is either calls that
    validate (finish_reason "tool_calls") or content in which the tag never occurs; streamed == non-streamed.
    (The tiny random model answers text here; the call branch: the grammar and streaming tests below.)"""
    specs = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(2):
        kwargs = {"model": MODEL_NAME, "messages": USER, "tools": [WEATHER, TIME], "max_tokens": 32,
                  "temperature": 1.0, "seed": seed}
        choice = sclient.chat.completions.create(**kwargs).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), specs[call.function.name])
        else:
            assert "<tool_call>" not in choice.message.content
        content, args = "", ""
        for chunk in sclient.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                content += c.delta.content or ""
                args += "".join(d.function.arguments or "" for d in c.delta.tool_calls or [])
        if choice.message.tool_calls:
            assert args == "".join(c.function.arguments for c in choice.message.tool_calls) and not content
        else:
            assert content == choice.message.content and not args


def test_auto_grammar_takes_calls_or_tagless_text(long_llm):
    from celeris.structured.grammar import Constraint, tool_call_grammar

    functions = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    grammar = tool_call_grammar(functions, alternative="text")
    tok, eos = long_llm.tokenizer, long_llm.tokenizer.eos_token_id

    def accepted(text: str) -> bool:
        ids = tok.encode(text) + [eos]
        return Constraint(grammar, long_llm.grammar_tokenizer).matcher.validate_tokens(ids) == len(ids)

    assert accepted("It is sunny.")
    assert accepted('<tool_call>{"name":"get_time","arguments":{"zone":3}}</tool_call>')
    assert not accepted('<tool_call>{"name":"get_time","arguments":{"zone":30}}</tool_call>')  # maximum 12
    assert not accepted('<tool_call>{"name":"nope","arguments":{}}</tool_call>')
    assert not accepted('Let me check. <tool_call>{"name":"get_time","arguments":{"zone":3}}</tool_call>')
    assert not accepted("")


def test_auto_streams_text_before_the_answer_ends():
    """Under the auto grammar a text answer streams from its first character that cannot begin the call tag;
    an answer that starts with the tag streams as calls."""
    import asyncio

    from celeris.serve.chat import chat_chunks
    from celeris.serve.detokenize import Update
    from celeris.serve.protocol import ChatCompletionChunk

    def chunk(choices):
        return ChatCompletionChunk(id="x", created=0, model="m", choices=choices)

    async def run(pieces: list[str]) -> list:
        async def updates():
            for i, p in enumerate(pieces):
                yield Update(0, p, "stop" if i == len(pieces) - 1 else None), p, None
        functions = {"get_time": TIME["function"]["parameters"]}
        return [c async for c in chat_chunks(updates(), 1, "auto", functions, True, False, chunk)]

    text = asyncio.run(run(["<to", "y", "u ", "there"]))[1:]
    assert [c.choices[0].delta.content for c in text] == ["<toy", "u ", "there"]
    call = asyncio.run(run(["<tool_", 'call>{"name":"get_time","arguments":{"zone"', ":1}}</tool_call>"]))[1:]
    assert call[0].choices[0].delta.tool_calls[0].function.name == "get_time"
    assert "".join(d.function.arguments or "" for c in call for d in c.choices[0].delta.tool_calls or []) == \
        '{"zone":1}'
    assert call[-1].choices[0].finish_reason == "tool_calls"


def test_stop_strings_never_cut_constrained_json(sclient):
    """A stop string that occurs in the JSON does not end a constrained answer (stop strings end free text only)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "flat", "schema": SCHEMAS["flat"], "strict": True}}
    kwargs = {"model": MODEL_NAME, "messages": USER, "response_format": fmt, "max_tokens": 96, "seed": 4}
    plain = sclient.chat.completions.create(**kwargs).choices[0]
    stopped = sclient.chat.completions.create(stop=['"', ":"], **kwargs).choices[0]
    assert stopped.message.content == plain.message.content and stopped.finish_reason == "stop"
    jsonschema.validate(json.loads(stopped.message.content), SCHEMAS["flat"])
    streamed = "".join(c.choices[0].delta.content or "" for c in sclient.chat.completions.create(
        stream=True, stop=['"'], **kwargs) if c.choices)
    assert streamed == plain.message.content


def test_stop_strings_apply_to_free_text_only():
    from celeris.structured.grammar import json_object_grammar, stops_apply, tool_call_grammar
    from celeris.text import IncrementalText

    auto = tool_call_grammar({"f": {"type": "object"}}, alternative="text")
    assert stops_apply(None, "x") is True and stops_apply(json_object_grammar(), "x") is False
    assert stops_apply(auto, "<tool_call>{") is False and stops_apply(auto, "<tool") is None
    assert stops_apply(auto, "<toy") is True

    def stream(pieces: list[str], grammar: str | None) -> tuple[str, bool]:
        text = IncrementalText(lambda ids: "".join(pieces[: len(ids)]), ["}"], grammar=grammar)
        out = "".join(text.push([i], final=i == len(pieces) - 1) for i in range(len(pieces)))
        return out, text.stopped

    assert stream(["a {b}", " c"], auto) == ("a {b", True)
    call = ['<tool_call>{"name":"f",', '"arguments":{}}', "</tool_call>"]
    assert stream(call, auto) == ("".join(call), False)
    assert stream(['{"a":', "{}}"], json_object_grammar()) == ('{"a":{}}', False)
    assert stream(["<to", "o}"], auto) == ("<too", True)


def test_auto_decodes_unconstrained_where_a_grammar_cannot_run(tmp_path):
    """A hybrid model in block mode (block_length > 1) cannot decode under a grammar: tool_choice "auto" then
    decodes without one (text), while a forced call, which needs the grammar, is a 400."""
    import asyncio

    from tests.serve.conftest import make_serving

    llm = LLM(build_tiny_checkpoint(tmp_path, TEXTS, MODEL_NAME, 2048, GENERATION_CONFIG, is_causal=True,
                                    draft_block_size=4), device="cpu")
    serving = make_serving(llm)
    serving.start()
    try:
        body = {"model": MODEL_NAME, "messages": USER, "tools": [TIME], "max_tokens": 8, "block_length": 4,
                "decoding": "fixed", "steps": 8}
        status, out = asyncio.run(serving.respond("/v1/chat/completions", body))
        assert status == 200 and isinstance(out["choices"][0]["message"]["content"], str)
        status, out = asyncio.run(serving.respond("/v1/chat/completions", {**body, "tool_choice": "required"}))
        assert status == 400 and out["error"]["param"] == "tool_choice"
    finally:
        serving.stop()


@pytest.mark.slow
def test_forced_call_of_a_nested_pydantic_tool_validates(sclient):
    """Issue 28 item 1 end to end: a tool whose parameters are a pydantic model with a nested model ($defs/$ref)
    is served for required and named tool_choice, and the call's arguments validate against the nested schema."""
    tool = {"type": "function", "function": {"name": "register", "parameters": Person.model_json_schema()}}
    assert "$defs" in tool["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": "register"}}):
        out = sclient.chat.completions.create(model=MODEL_NAME, messages=USER, tools=[tool], tool_choice=choice,
                                              parallel_tool_calls=False, max_tokens=128, temperature=0.7, seed=5)
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "register" and out.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


SELF_REF = {"type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}


def _raw(sclient) -> str:
    return str(sclient.base_url).rstrip("/").removesuffix("/v1")


def test_a_schema_without_a_finite_value_is_400_naming_the_field(sclient):
    """``{"$ref": "#"}`` used to be answered 200 with an empty content and finish_reason "stop"."""
    import httpx

    base, param = _raw(sclient), "response_format.json_schema.schema"
    bodies = {"/v1/chat/completions": {"messages": USER}, "/v1/completions": {"prompt": "def f(x):"}}
    for path, body in bodies.items():
        for stream in (False, True):
            r = httpx.post(base + path, json={**body, "max_tokens": 8, "response_format": SELF_REF, "stream": stream},
                           timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    loop = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}
    with pytest.raises(openai.BadRequestError) as info:
        sclient.chat.completions.create(model=MODEL_NAME, messages=USER, tools=[loop], tool_choice="required",
                                        max_tokens=8)
    assert info.value.body["param"] == "tools[0].function.parameters"


def test_a_constrained_answer_that_does_not_validate_is_never_stop(sclient, monkeypatch):
    """With the compile-time checks switched off, ``{"$ref": "#"}`` reaches the engine, which ends the answer at
    once: the serving layer's check turns that "stop" into a 500 ``invalid_output`` (an error event when streamed),
    counted in /metrics."""
    import httpx

    # raising=False: the same test runs on code without these checks (where it gets 200 and "stop")
    monkeypatch.setattr("celeris.structured.grammar.has_finite_value", lambda schema: True, raising=False)
    monkeypatch.setattr("celeris.serve.tools.check_grammar", lambda grammar, tokenizer, param: None, raising=False)
    base = _raw(sclient)
    key = 'celeris_failed_requests_total{code="invalid_output",model="tiny-serve"}'

    def failures() -> float:
        lines = [line for line in httpx.get(base + "/metrics").text.splitlines() if line.startswith(key)]
        return float(lines[0].split()[-1]) if lines else 0.0

    before = failures()
    with pytest.raises(openai.InternalServerError) as info:
        sclient.chat.completions.create(model=MODEL_NAME, messages=USER, response_format=SELF_REF, max_tokens=8)
    assert info.value.body["code"] == "invalid_output"
    r = httpx.post(base + "/v1/completions", json={"prompt": "def", "max_tokens": 8, "response_format": SELF_REF})
    assert r.status_code == 500 and r.json()["error"]["code"] == "invalid_output"
    events = [line.removeprefix("data: ") for line in httpx.post(
        base + "/v1/chat/completions", json={"messages": USER, "max_tokens": 8, "response_format": SELF_REF,
                                             "stream": True}, timeout=30).text.splitlines() if line]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "invalid_output"
    assert all(json.loads(e).get("choices", [{}])[0].get("finish_reason") != "stop" for e in events[:-2])
    assert failures() == before + 3


def test_a_constrained_answer_cut_by_the_budget_is_length(sclient):
    long = {"type": "json_schema", "json_schema": {"name": "long", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "minLength": 40}}, "required": ["a"]}}}
    chat = sclient.chat.completions.create(model=MODEL_NAME, messages=USER, response_format=long, max_tokens=4)
    assert chat.choices[0].finish_reason == "length"
    text = sclient.completions.create(model=MODEL_NAME, prompt="def", max_tokens=4,
                                      extra_body={"response_format": long})
    assert text.choices[0].finish_reason == "length"
