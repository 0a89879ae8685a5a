"""Chat chunks -> Responses events: the order OpenAI sends, consecutive sequence numbers, output indexes and item
ids, the finished response (completed / incomplete), and a failure as ``error`` + ``response.failed``."""

from __future__ import annotations

import asyncio

from celeris.serve.protocol import (
    APIError,
    ChatCompletionChunk,
    ChatStreamChoice,
    DecodingDetails,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    UsageInfo,
)
from celeris.serve.responses.protocol import ResponseObject
from celeris.serve.responses.stream import response_events

DETAILS = DecodingDetails(nfe=4, steps=4, tokens_per_forward=1.5, block_length=8, cache="none", decoding="fixed",
                          remasking="low_confidence")
USAGE = UsageInfo(prompt_tokens=5, completion_tokens=6, total_tokens=11, nfe=4)
MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                  "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                  "response.output_item.done"]


def chunk(delta: DeltaMessage | None = None, finish_reason: str | None = None,
          usage: UsageInfo | None = None) -> ChatCompletionChunk:
    choices = [] if delta is None else [ChatStreamChoice(index=0, delta=delta, finish_reason=finish_reason,
                                                         celeris=DETAILS if finish_reason else None)]
    return ChatCompletionChunk(id="c", created=0, model="m", choices=choices, usage=usage)


def run(chunks: list, fail: APIError | None = None) -> tuple[list, list]:
    async def source():
        for c in chunks:
            yield c
        if fail is not None:
            raise fail

    async def collect():
        kept = []
        base = ResponseObject(created_at=0, status="in_progress", model="m")
        return [e async for e in response_events(source(), base, kept.append)], kept

    return asyncio.run(collect())


def test_text_events_in_order_add_up_to_the_finished_response():
    events, kept = run([chunk(DeltaMessage(role="assistant", content="")), chunk(DeltaMessage(content="he")),
                        chunk(DeltaMessage(content="llo"), "stop"), chunk(usage=USAGE)])
    assert [e.type for e in events] == ["response.created", "response.in_progress", *MESSAGE_EVENTS,
                                        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in events[3:8])
    assert "".join(e.delta for e in events if e.type.endswith("text.delta")) == events[6].text == "hello"
    final = events[-1].response
    assert kept == [final] and final.status == "completed" and final.output_text == "hello"
    assert final.output[0].id == item_id and final.output[0].status == "completed"
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (5, 6, 11)
    assert final.celeris == DETAILS


def test_a_budget_that_ran_out_is_incomplete():
    events, _ = run([chunk(DeltaMessage(content="ab")), chunk(DeltaMessage(content="c"), "length"),
                     chunk(usage=USAGE)])
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.status == "incomplete"
    assert final.response.incomplete_details.reason == "max_output_tokens"
    assert final.response.output[0].status == "incomplete"


def test_tool_call_deltas_become_function_call_items():
    def call(index, id_=None, name=None, arguments=None):
        return chunk(DeltaMessage(tool_calls=[DeltaToolCall(index=index, id=id_, type="function" if id_ else None,
                                                            function=DeltaFunctionCall(name=name,
                                                                                       arguments=arguments))]))

    events, _ = run([chunk(DeltaMessage(role="assistant", content="")), call(0, "call_a", "f", ""),
                     call(0, arguments='{"x":'), call(0, arguments="1}"), call(1, "call_b", "g", ""),
                     call(1, arguments="{}"), chunk(DeltaMessage(), "tool_calls"), chunk(usage=USAGE)])
    assert [e.type for e in events[2:-1]] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert events[5].arguments == '{"x":1}' and events[5].name == "f" and events[5].output_index == 0
    assert events[-2].output_index == 1
    final = events[-1].response
    assert final.status == "completed" and final.output_text == ""
    assert [(o.call_id, o.name, o.arguments, o.status) for o in final.output] == [
        ("call_a", "f", '{"x":1}', "completed"), ("call_b", "g", "{}", "completed")]


def test_an_empty_answer_is_an_empty_message():
    events, _ = run([chunk(DeltaMessage(role="assistant", content="")), chunk(DeltaMessage(content=""), "stop"),
                     chunk(usage=USAGE)])
    assert [e.type for e in events[2:-1]] == [t for t in MESSAGE_EVENTS if not t.endswith("text.delta")]
    assert events[-1].response.output[0].content[0].text == ""


def test_a_failure_is_an_error_event_then_response_failed():
    events, kept = run([chunk(DeltaMessage(content="ab"))],
                       fail=APIError(504, "the request did not finish", code="request_timeout"))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].code == "request_timeout" and events[-2].message == "the request did not finish"
    assert events[-1].response.status == "failed" and events[-1].response.error.code == "request_timeout"
    assert [e.sequence_number for e in events] == list(range(len(events))) and kept == []
