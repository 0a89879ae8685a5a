"""The Responses API through the official ``openai`` client against a live server: every answer is held to the
chat completions route's answer for the same conversation and seed (the path it is translated onto), and the
streamed events (through the client's stream helper, which raises on a missing or out-of-order event) add up
to the non-streamed response."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.serve.conftest import MODEL_NAME
from tests.serve.test_structured import Person

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                           "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
QUESTION = "What is the weather in Paris?"
SAMPLED = {"temperature": 1.0, "max_output_tokens": 24}


def chat_tool(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def answer(response) -> list[tuple]:
    """A response's output as ("text", text) / ("call", name, arguments) tuples."""
    return [("call", o.name, o.arguments) if o.type == "function_call" else ("text", o.content[0].text)
            for o in response.output]


def chat_answer(completion) -> list[tuple]:
    message = completion.choices[0].message
    if message.tool_calls:
        return [("call", c.function.name, c.function.arguments) for c in message.tool_calls]
    return [("text", message.content)]


def test_a_text_answer_is_the_chat_answer(rclient):
    r = rclient.responses.create(model=MODEL_NAME, input=QUESTION, instructions="Be brief.", extra_body={"seed": 5},
                                 **SAMPLED)
    chat = rclient.chat.completions.create(model=MODEL_NAME, messages=[{"role": "system", "content": "Be brief."},
                                                                        {"role": "user", "content": QUESTION}],
                                           max_tokens=24, temperature=1.0, seed=5)
    assert r.object == "response" and r.model == MODEL_NAME and r.id.startswith("resp_")
    assert answer(r) == chat_answer(chat) and r.output_text == chat.choices[0].message.content
    assert r.model_extra["output_text"] == r.output_text  # sent for raw HTTP users too
    finished = chat.choices[0].finish_reason
    assert r.status == ("incomplete" if finished == "length" else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert r.model_extra["celeris"]["nfe"] == chat.choices[0].model_extra["celeris"]["nfe"] > 0


def test_parse_returns_a_nested_pydantic_object(rclient):
    for seed in range(2):
        r = rclient.responses.parse(model=MODEL_NAME, input=QUESTION, text_format=Person, max_output_tokens=96,
                                    temperature=0.7, extra_body={"seed": seed})
        assert r.status == "completed" and isinstance(r.output_parsed, Person)
        assert r.text.format.type == "json_schema"


def test_a_tool_call_and_its_output_follow_up(rclient):
    r = rclient.responses.create(model=MODEL_NAME, input=QUESTION, tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, temperature=0.7, max_output_tokens=96,
                                 extra_body={"seed": 1})
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 == len(r.output) and r.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.status == "completed" and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    chat = rclient.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION}],
                                           tools=[chat_tool(WEATHER)], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0.7, max_tokens=96, seed=1)
    assert answer(r) == chat_answer(chat)

    follow = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    r2 = rclient.responses.create(model=MODEL_NAME, input=follow, tools=[WEATHER], extra_body={"seed": 2},
                                  **SAMPLED)
    history = [{"role": "user", "content": QUESTION},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.call_id, "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    chat2 = rclient.chat.completions.create(model=MODEL_NAME, messages=history, tools=[chat_tool(WEATHER)],
                                            max_tokens=24, temperature=1.0, seed=2)
    assert answer(r2) == chat_answer(chat2)


def test_previous_response_id_continues_the_stored_conversation(rclient):
    r1 = rclient.responses.create(model=MODEL_NAME, input=QUESTION, extra_body={"seed": 3}, **SAMPLED)
    r2 = rclient.responses.create(model=MODEL_NAME, input="And tomorrow?", previous_response_id=r1.id,
                                  extra_body={"seed": 4}, **SAMPLED)
    assert r2.previous_response_id == r1.id
    chat = rclient.chat.completions.create(model=MODEL_NAME, max_tokens=24, temperature=1.0, seed=4, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "And tomorrow?"}])
    assert answer(r2) == chat_answer(chat)
    assert r2.usage.input_tokens == chat.usage.prompt_tokens
    r3 = rclient.responses.create(model=MODEL_NAME, input="Thanks.", previous_response_id=r2.id,
                                  instructions="Be brief.", extra_body={"seed": 5}, **SAMPLED)
    chat3 = rclient.chat.completions.create(model=MODEL_NAME, max_tokens=24, temperature=1.0, seed=5, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": r2.output_text}, {"role": "user", "content": "Thanks."}])
    assert answer(r3) == chat_answer(chat3)  # two stored turns back; the new instructions come first


def test_stored_responses_are_retrieved_and_unknown_ones_are_404(rclient):
    r = rclient.responses.create(model=MODEL_NAME, input=QUESTION, metadata={"run": "7"}, extra_body={"seed": 3},
                                 **SAMPLED)
    got = rclient.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"run": "7"}
    unstored = rclient.responses.create(model=MODEL_NAME, input=QUESTION, store=False, **SAMPLED)
    for rid in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as info:
            rclient.responses.retrieve(rid)
        assert info.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as info:
        rclient.responses.create(model=MODEL_NAME, input="x", previous_response_id="resp_unknown")
    assert info.value.body["param"] == "previous_response_id"
    rclient.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        rclient.responses.retrieve(r.id)


def streamed(rclient, **fields) -> list:
    with rclient.responses.stream(model=MODEL_NAME, **fields) as stream:
        return list(stream)


def test_a_stream_reassembles_to_the_non_streamed_answer(rclient):
    fields = {"input": QUESTION, "extra_body": {"seed": 6}, **SAMPLED}
    events = streamed(rclient, **fields)
    plain = rclient.responses.create(model=MODEL_NAME, **fields)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:3]] == ["response.created", "response.in_progress", "response.output_item.added"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert events[-1].type == f"response.{plain.status}"
    assert text == final.output_text == plain.output_text and answer(final) == answer(plain)
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert rclient.responses.retrieve(final.id).output_text == text  # a stream is stored too


@pytest.mark.slow  # ~4 s: four answers under grammars
def test_a_streamed_schema_answer_and_tool_call(rclient):
    fields = {"input": QUESTION, "text_format": Person, "max_output_tokens": 96, "temperature": 0.7,
              "extra_body": {"seed": 0}}
    with rclient.responses.stream(model=MODEL_NAME, **fields) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == rclient.responses.parse(model=MODEL_NAME, **fields).output_parsed

    fields = {"input": QUESTION, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
              "max_output_tokens": 96, "temperature": 0.7, "extra_body": {"seed": 8}}
    events = streamed(rclient, **fields)
    plain = rclient.responses.create(model=MODEL_NAME, **fields)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == deltas == plain.output[0].arguments
    assert events[-1].type == "response.completed" and answer(events[-1].response) == answer(plain)
