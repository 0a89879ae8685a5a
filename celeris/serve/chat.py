"""Chat answers for the serving layer: a finished choice as ``message`` (content, or ``tool_calls``), and the
chunks of a streamed chat answer (content deltas, or OpenAI tool-call deltas).

How a choice's text becomes calls depends on ``tool_choice`` (``celeris.serve.tools``):

- ``required`` / a named function: the grammar makes the answer nothing but calls; they stream as written
  (``CallStreamer``);
- ``auto`` under its grammar (calls, or text in which the call tag never occurs): the first characters decide;
  an answer that starts with the call tag streams as calls, any other streams as content from its first
  character that cannot begin the tag;
- ``auto`` without a grammar (a model that cannot decode under one): the text is held until the choice ends, then
  sent as calls if it is nothing but valid calls, else as content;
- ``none`` or no tools, and ``stream_mode: "denoise"``: content.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from celeris.serve.detokenize import Update
from celeris.serve.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatMessageOut,
    ChatStreamChoice,
    ChoiceLogprobs,
    DecodingDetails,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
)
from celeris.serve.tools import CallStreamer, parse_tool_calls
from celeris.structured.grammar import TOOL_CALL_OPEN

Chunk = Callable[[list[ChatStreamChoice]], ChatCompletionChunk]


def chat_choice(index: int, text: str, finish_reason: str | None, details: DecodingDetails | None,
                functions: dict[str, dict]) -> ChatChoice:
    """A finished choice: ``tool_calls`` (``content: null``, ``finish_reason: "tool_calls"``) when ``text`` is
    nothing but valid calls of ``functions`` and ended by "stop", else ``content``."""
    calls = parse_tool_calls(text, functions) if functions and finish_reason == "stop" else None
    message = ChatMessageOut(content=None, tool_calls=calls) if calls else ChatMessageOut(content=text)
    return ChatChoice(index=index, message=message, finish_reason="tool_calls" if calls else finish_reason,
                      celeris=details)


class _ChoiceStream:
    """One choice's streaming state when tools are declared; ``kind``: "calls", "text", "held" (until the end) or
    None (``auto`` under its grammar, until the first characters decide)."""

    def __init__(self, kind: str | None) -> None:
        self.kind = kind
        self.held = ""
        self.calls = CallStreamer()

    def decide(self, text: str, finished: bool) -> str:
        """Append ``text``; once the kind is known, the text to send (all that was held)."""
        self.held += text
        if self.kind is None:
            if self.held.startswith(TOOL_CALL_OPEN):
                self.kind = "calls"
            elif finished or not TOOL_CALL_OPEN.startswith(self.held):
                self.kind = "text"
            else:
                return ""
        if self.kind == "held" and not finished:
            return ""
        out, self.held = self.held, ""
        return out


async def chat_chunks(pieces: AsyncIterator[tuple[Update, str, int | None]], num_choices: int, mode: str,
                      functions: dict[str, dict], constrained: bool, denoise: bool,
                      chunk: Chunk, logprobs: Callable[[list], ChoiceLogprobs] | None = None,
                      ) -> AsyncIterator[ChatCompletionChunk]:
    """The chunks of a streamed chat answer (module docstring), the usage chunk excepted.

    Args:
        pieces: (update, text to send, denoising step) per update (``OpenAIServing._stream_pieces``).
        mode: ``tool_mode`` of the request; functions: its declared functions ({} for ``none``).
        constrained: the answers were decoded under the request's grammar.
        denoise: ``stream_mode: "denoise"`` (canvases are sent as content, never parsed).
        chunk: wraps a list of stream choices in a chunk (id, created, model).
        logprobs: formats an update's released log-probability entries (``Update.logprobs``) as a chunk's
            ``logprobs``; they are sent with content deltas (not with tool-call deltas).
    """

    def scores(u: Update) -> ChoiceLogprobs | None:
        return None if logprobs is None or u.logprobs is None else logprobs(u.logprobs)

    for i in range(num_choices):
        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
    kind = "calls" if mode in ("required", "named") else None if constrained else "held"
    streams = [_ChoiceStream(kind) for _ in range(num_choices)]
    async for u, text, step in pieces:
        if not functions or denoise:
            yield chunk([ChatStreamChoice(index=u.index, delta=DeltaMessage(content=text),
                                          finish_reason=u.finish_reason, step=step, celeris=u.details,
                                          logprobs=scores(u))])
            continue
        stream = streams[u.index]
        text = stream.decide(text, u.finish_reason is not None)
        if stream.kind == "text":
            if text or u.finish_reason is not None:
                yield chunk([ChatStreamChoice(index=u.index, delta=DeltaMessage(content=text),
                                              finish_reason=u.finish_reason, celeris=u.details, logprobs=scores(u))])
        elif stream.kind == "calls":  # the grammar makes the answer calls: stream them as they are written
            for delta in stream.calls.push(text):
                yield chunk([ChatStreamChoice(index=u.index, delta=DeltaMessage(tool_calls=[delta]))])
            if u.finish_reason is not None:
                reason = "tool_calls" if u.finish_reason == "stop" and stream.calls.calls else u.finish_reason
                yield chunk([ChatStreamChoice(index=u.index, delta=DeltaMessage(), finish_reason=reason,
                                              celeris=u.details)])
        elif u.finish_reason is not None:  # "held": the whole answer at its end
            async for c in _held_answer(u, text, functions, chunk):
                yield c


async def _held_answer(u: Update, text: str, functions: dict[str, dict],
                       chunk: Chunk) -> AsyncIterator[ChatCompletionChunk]:
    """A held answer at its end: as calls (id, type and name first, then the arguments, as OpenAI) when it is
    nothing but valid calls, else as one content delta."""
    calls = parse_tool_calls(text, functions) if u.finish_reason == "stop" else None
    if not calls:
        yield chunk([ChatStreamChoice(index=u.index, delta=DeltaMessage(content=text), finish_reason=u.finish_reason,
                                      celeris=u.details)])
        return
    for k, call in enumerate(calls):
        first = DeltaToolCall(index=k, id=call.id, type="function",
                              function=DeltaFunctionCall(name=call.function.name, arguments=""))
        yield chunk([ChatStreamChoice(index=u.index, delta=DeltaMessage(tool_calls=[first]))])
        rest = DeltaToolCall(index=k, function=DeltaFunctionCall(arguments=call.function.arguments))
        yield chunk([ChatStreamChoice(index=u.index, delta=DeltaMessage(tool_calls=[rest]))])
    yield chunk([ChatStreamChoice(index=u.index, delta=DeltaMessage(), finish_reason="tool_calls", celeris=u.details)])
