"""A streamed chat answer as OpenAI's typed Responses events, in their order, each with its ``sequence_number``:

``response.created`` -> ``response.in_progress`` -> per output item ``response.output_item.added`` -> (a message)
``response.content_part.added`` -> ``response.output_text.delta``* -> ``response.output_text.done`` ->
``response.content_part.done``, or (a function call) ``response.function_call_arguments.delta``* ->
``response.function_call_arguments.done`` -> ``response.output_item.done`` -> ``response.completed`` (or
``response.incomplete`` when the token budget ran out). A failure after the stream began is an ``error`` event
followed by ``response.failed``.

The chat stream already decides what is text and what is a call (``celeris.serve.chat.chat_chunks``): its content
deltas become a message's text deltas, its tool-call deltas (id and name first, then the arguments) become
function-call items, so the events add up to the non-streamed response for the same seed.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from celeris.serve.protocol import APIError, ChatCompletionChunk, DecodingDetails, DeltaToolCall, UsageInfo
from celeris.serve.responses.convert import finish
from celeris.serve.responses.protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    LifecycleEvent,
    OutputFunctionCall,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponseErrorInfo,
    ResponseObject,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from celeris.serve.serving import ClientDisconnected

logger = logging.getLogger(__name__)


class _Events:
    """The numbering of a stream's events and the output items opened and finished so far."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.output: list[OutputItem] = []
        self.open: OutputMessage | OutputFunctionCall | None = None
        self.buffer = ""  # the open item's text or arguments so far

    def emit(self, event: StreamEvent) -> StreamEvent:
        event.sequence_number = self.sequence_number
        self.sequence_number += 1
        return event

    @property
    def index(self) -> int:
        return len(self.output)

    def text(self, delta: str) -> list[StreamEvent]:
        """A piece of answer text: opens a message (and its text part) first if none is open."""
        out = []
        if not isinstance(self.open, OutputMessage):
            out += self.close(truncated=False)
            self.open = OutputMessage(status="in_progress")
            out.append(self.emit(OutputItemEvent(type="response.output_item.added", output_index=self.index,
                                                 item=self.open.model_copy())))
            out.append(self.emit(ContentPartEvent(type="response.content_part.added", item_id=self.open.id,
                                                  output_index=self.index, part=OutputText(text=""))))
        if delta:
            self.buffer += delta
            out.append(self.emit(TextDeltaEvent(item_id=self.open.id, output_index=self.index, delta=delta)))
        return out

    def call(self, delta: DeltaToolCall) -> list[StreamEvent]:
        """A piece of a call: its first (id, name) opens a function-call item, the rest are argument deltas."""
        out = []
        if delta.id is not None:
            out += self.close(truncated=False)
            self.open = OutputFunctionCall(call_id=delta.id, name=delta.function.name or "", arguments="",
                                           status="in_progress")
            out.append(self.emit(OutputItemEvent(type="response.output_item.added", output_index=self.index,
                                                 item=self.open.model_copy())))
        if delta.function.arguments and isinstance(self.open, OutputFunctionCall):
            self.buffer += delta.function.arguments
            out.append(self.emit(ArgumentsDeltaEvent(item_id=self.open.id, output_index=self.index,
                                                     delta=delta.function.arguments)))
        return out

    def close(self, truncated: bool) -> list[StreamEvent]:
        """Finish the open item, if any (``incomplete`` when the budget ran out)."""
        item, text, out = self.open, self.buffer, []
        if item is None:
            return out
        status = "incomplete" if truncated else "completed"
        if isinstance(item, OutputMessage):
            part = OutputText(text=text)
            out.append(self.emit(TextDoneEvent(item_id=item.id, output_index=self.index, text=text)))
            out.append(self.emit(ContentPartEvent(type="response.content_part.done", item_id=item.id,
                                                  output_index=self.index, part=part)))
            done = item.model_copy(update={"status": status, "content": [part]})
        else:
            out.append(self.emit(ArgumentsDoneEvent(item_id=item.id, output_index=self.index, name=item.name,
                                                    arguments=text)))
            done = item.model_copy(update={"status": status, "arguments": text})
        out.append(self.emit(OutputItemEvent(type="response.output_item.done", output_index=self.index, item=done)))
        self.output.append(done)
        self.open, self.buffer = None, ""
        return out


async def response_events(chunks: AsyncIterator[ChatCompletionChunk], response: ResponseObject,
                          on_finish: Callable[[ResponseObject], None]) -> AsyncIterator[StreamEvent]:
    """The events of ``response`` (status ``in_progress``) from the chat stream ``chunks`` (``stream_options.
    include_usage`` on, one choice); ``on_finish`` gets the finished response before its last event (the store).
    ``ClientDisconnected`` passes through (the client is gone: nothing to send)."""
    events = _Events()
    yield events.emit(LifecycleEvent(type="response.created", response=response))
    yield events.emit(LifecycleEvent(type="response.in_progress", response=response))
    usage: UsageInfo | None = None
    details: DecodingDetails | None = None
    finish_reason: str | None = None
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    for event in events.text(choice.delta.content) if choice.delta.content else []:
                        yield event
                    for delta in choice.delta.tool_calls or []:
                        for event in events.call(delta):
                            yield event
                    if choice.finish_reason is not None:
                        finish_reason, details = choice.finish_reason, choice.celeris
    except APIError as exc:
        async for event in _failed(events, response, exc.code, exc.message, exc.param):
            yield event
        return
    except ClientDisconnected:
        raise
    except Exception as exc:  # a bug must still end the stream in the documented way
        logger.exception("responses stream failed")
        async for event in _failed(events, response, "server_error", f"internal error: {type(exc).__name__}", None):
            yield event
        return
    truncated = finish_reason == "length"
    if events.open is None and not events.output:  # an empty answer is an empty message, as when not streamed
        for event in events.text(""):
            yield event
    for event in events.close(truncated):
        yield event
    final = finish(response, events.output, usage, details, truncated)
    on_finish(final)
    yield events.emit(LifecycleEvent(type="response.incomplete" if truncated else "response.completed",
                                     response=final))


async def _failed(events: _Events, response: ResponseObject, code: str | None, message: str,
                  param: str | None) -> AsyncIterator[StreamEvent]:
    yield events.emit(ErrorEvent(code=code, message=message, param=param))
    failed = response.model_copy(update={"status": "failed", "output": list(events.output),
                                         "error": ResponseErrorInfo(code=code or "server_error", message=message)})
    yield events.emit(LifecycleEvent(type="response.failed", response=failed))
