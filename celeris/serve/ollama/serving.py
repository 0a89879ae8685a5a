"""Ollama's requests translated into the OpenAI serving layer's (``ChatCompletionRequest``, ``CompletionRequest``),
and its streams translated back into Ollama's chunks.

There is one request path: ``/api/chat`` becomes a chat completion, ``/api/generate`` a chat completion of one user
turn (or, with ``raw`` or ``suffix``, a completion), and both run through ``OpenAIServing`` (validation, limits,
the engine, grammars, tool calls, metrics). Both are asked of the serving layer as streams; a non-streamed Ollama
answer is the stream put together (so the counters and durations are measured the same way in both).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from celeris.serve.errors import APIError, validation_error
from celeris.serve.ollama.protocol import (
    ChatChunk,
    ChatRequest,
    GenerateChunk,
    GenerateRequest,
    Message,
    MessageOut,
    Options,
    ToolCall,
    ToolCallFunction,
)
from celeris.serve.protocol import ChatCompletionRequest, CompletionRequest
from celeris.serve.serving import IsDisconnected

NS = 1_000_000_000


# the OpenAI request's names in the serving layer's messages -> the Ollama request's (longest first)
OLLAMA_FIELD_NAMES = (("response_format.json_schema.schema", "format"), ("response_format", "format"),
                      ("max_tokens", "options.num_predict"), ("repetition_penalty", "options.repeat_penalty"),
                      ("'stop'", "'options.stop'"))


def with_ollama_names(exc: APIError) -> APIError:
    """``exc`` with the OpenAI field names in its message written as the Ollama request names them."""
    message, param = exc.message, exc.param
    for openai_name, ollama_name in OLLAMA_FIELD_NAMES:
        message = message.replace(openai_name, ollama_name)
        if param is not None:
            param = param.replace(openai_name.strip("'"), ollama_name.strip("'"))
    return APIError(exc.status_code, message, type=exc.type, param=param, code=exc.code, headers=exc.headers)


def refuse_unsupported(names: list[str]) -> None:
    """400 naming the fields Celeris cannot honour (set to anything but their neutral value)."""
    if names:
        hint = " (Celeris's denoising steps go in options.steps)" if "steps" in names else ""
        raise APIError(400, f"unsupported field(s): {', '.join(names)}; Celeris does not implement them (send them "
                            f"unset, or at their neutral value){hint}", param=names[0])


def sampling_body(options: Options | None, context_length: int) -> dict[str, object]:
    """``options`` as the OpenAI request's fields: ``num_predict`` -> ``max_tokens`` (-1 and -2, Ollama's
    "unlimited" and "fill the context": None, the room left), ``repeat_penalty`` -> ``repetition_penalty``,
    ``stop``, ``temperature``, ``top_p``, ``seed`` and the Celeris settings by name.

    Raises:
        APIError: 400 for ``num_predict`` 0 or below -2, and for ``num_ctx`` outside 1 .. ``context_length``.
    """
    if options is None:
        return {}
    body: dict[str, object] = options.celeris_settings()
    if options.num_predict is not None and options.num_predict not in (-1, -2):
        if options.num_predict < 1:
            raise APIError(400, f"options.num_predict must be >= 1, or -1 / -2 for as many tokens as fit; got "
                                f"{options.num_predict}", param="options.num_predict")
        body["max_tokens"] = options.num_predict
    if options.num_ctx is not None and not 1 <= options.num_ctx <= context_length:
        raise APIError(400, f"options.num_ctx is {options.num_ctx}, but this model is served with a context of "
                            f"{context_length} tokens (prompt + answer); send num_ctx <= {context_length} or leave it "
                            "unset", param="options.num_ctx")
    for name in ("temperature", "top_p", "seed"):
        if getattr(options, name) is not None:
            body[name] = getattr(options, name)
    if options.repeat_penalty is not None:
        body["repetition_penalty"] = options.repeat_penalty
    stop = [options.stop] if isinstance(options.stop, str) else options.stop
    if stop:
        body["stop"] = stop
    return body


def response_format(fmt: str | dict | None) -> dict | None:
    """``format``: ``"json"`` -> JSON mode, a JSON Schema -> that schema (both under the grammar path), ``""`` or
    null -> free text."""
    if not fmt:
        return None
    if fmt == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}


def chat_messages(messages: list[Message]) -> list[dict]:
    """Ollama's messages as OpenAI's: calls get ids (``call_<k>`` unless given) and their arguments as JSON text;
    a ``tool`` result answers, by ``tool_call_id`` if given, else the earliest unanswered call of ``tool_name``
    (else the earliest unanswered call)."""
    out: list[dict] = []
    pending: list[tuple[str, str]] = []  # (id, name) of calls not answered yet
    num_calls = 0
    for m in messages:
        d: dict = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            d["tool_calls"] = []
            for call in m.tool_calls:
                cid = call.id or f"call_{num_calls}"
                num_calls += 1
                pending.append((cid, call.function.name))
                d["tool_calls"].append({"id": cid, "type": "function", "function": {
                    "name": call.function.name, "arguments": json.dumps(call.function.arguments, ensure_ascii=False)}})
        if m.role == "tool":
            cid = m.tool_call_id
            if cid is None:
                match = [p for p in pending if p[1] == m.tool_name] or pending
                cid = match[0][0] if match else f"call_{num_calls}"
            pending = [p for p in pending if p[0] != cid]
            d["tool_call_id"] = cid
            if m.tool_name:
                d["name"] = m.tool_name
        out.append(d)
    return out


def _validated(model: type, body: dict):
    """The OpenAI request model for ``body`` built here; a refusal is a 400 naming the field."""
    from pydantic import ValidationError

    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise with_ollama_names(validation_error(exc)) from None


def chat_request(body: ChatRequest, model: str, context_length: int) -> ChatCompletionRequest:
    """The streamed chat completion that answers ``body`` (usage in its last chunk)."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []] or None
    choice = body.options.tool_choice if body.options is not None else None
    if choice is not None and choice not in ("auto", "none", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    return _validated(ChatCompletionRequest, {
        "model": model, "messages": chat_messages(body.messages), "tools": tools, "tool_choice": choice,
        "response_format": response_format(body.format), "stream": True, "stream_options": {"include_usage": True},
        **sampling_body(body.options, context_length)})


def generate_request(body: GenerateRequest, model: str,
                     context_length: int) -> ChatCompletionRequest | CompletionRequest:
    """The streamed request that answers ``body``: a completion for ``raw`` or ``suffix`` (infilling), else a chat
    completion of ``system`` and the prompt as the user turn.

    Raises:
        APIError: 400 for ``system`` with ``raw`` or ``suffix`` (the text would not reach the model), and for
            ``options.tool_choice``.
    """
    if body.options is not None and body.options.tool_choice is not None:
        raise APIError(400, "options.tool_choice is for /api/chat with tools; /api/generate has no tools",
                       param="options.tool_choice")
    common = {"model": model, "response_format": response_format(body.format), "stream": True,
              "stream_options": {"include_usage": True}, **sampling_body(body.options, context_length)}
    if body.raw or body.suffix:
        if body.system:
            why = "raw: true sends the prompt as it is" if body.raw else "an infilling prompt is sent as it is"
            raise APIError(400, f"system cannot be used here ({why}); write it into the prompt", param="system")
        return _validated(CompletionRequest, {"prompt": body.prompt or "", "suffix": body.suffix or None, **common})
    messages = [{"role": "system", "content": body.system}] * bool(body.system)
    return _validated(ChatCompletionRequest, {"messages": [*messages, {"role": "user", "content": body.prompt}],
                                              **common})


# ---------------------------------------------------------------------------------------------
# Streams back


@dataclass
class _Answer:
    """A streamed answer as it is put together: its calls (by index), timings and counts."""

    arrival: float
    calls: dict[int, dict] = field(default_factory=dict)  # index -> {"id", "name", "arguments" (JSON text)}
    first_piece: float | None = None
    finish_reason: str | None = None
    usage: object | None = None

    def tool_calls(self) -> list[ToolCall]:
        """The complete calls; a call whose arguments were cut by the budget (``done_reason: "length"``) is none."""
        out = []
        for i, c in sorted(self.calls.items()):
            try:
                arguments = json.loads(c["arguments"] or "{}")
            except ValueError:
                continue
            if isinstance(arguments, dict):
                out.append(ToolCall(id=c["id"], function=ToolCallFunction(index=i, name=c["name"], arguments=arguments)))
        return out

    def timings(self) -> dict[str, object]:
        """The final chunk's fields (``Timings``)."""
        end = time.perf_counter()
        first = self.first_piece or end
        usage = self.usage
        return {"done_reason": "length" if self.finish_reason == "length" else "stop",
                "total_duration": int((end - self.arrival) * NS), "load_duration": 0,
                "prompt_eval_count": getattr(usage, "prompt_tokens", 0),
                "prompt_eval_duration": int((first - self.arrival) * NS),
                "eval_count": getattr(usage, "completion_tokens", 0), "eval_duration": int((end - first) * NS)}


async def pieces(chunks: AsyncIterator, answer: _Answer) -> AsyncIterator[str]:
    """The answer text of an OpenAI chat or completion stream (one choice), as it comes; tool-call deltas are
    gathered into ``answer.calls`` and the finish reason and usage into ``answer``."""
    async with aclosing(chunks):
        async for chunk in chunks:
            if chunk.usage is not None:
                answer.usage = chunk.usage
            for choice in chunk.choices:
                delta = getattr(choice, "delta", None)
                text = choice.text if delta is None else delta.content or ""
                for call in (delta.tool_calls or []) if delta is not None else []:
                    got = answer.calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                    got["name"] += call.function.name or ""
                    got["arguments"] += call.function.arguments or ""
                if (text or answer.calls) and answer.first_piece is None:
                    answer.first_piece = time.perf_counter()
                if choice.finish_reason is not None:
                    answer.finish_reason = choice.finish_reason
                if text:
                    yield text


async def ollama_stream(chunks: AsyncIterator, arrival: float, model: str,
                        chat: bool) -> AsyncIterator[ChatChunk | GenerateChunk]:
    """Ollama's chunks for an OpenAI stream: one per text piece (``done: false``), the tool calls whole in one
    chunk when the answer is calls, then the final ``done: true`` chunk with ``done_reason`` and the counters."""
    answer = _Answer(arrival)

    def make(text: str, done: bool, calls: list[ToolCall] | None = None, **final: object):
        if chat:
            return ChatChunk(model=model, message=MessageOut(content=text, tool_calls=calls), done=done, **final)
        return GenerateChunk(model=model, response=text, done=done, **final)

    async with aclosing(pieces(chunks, answer)) as texts:  # closing this stream aborts the request at once
        async for text in texts:
            yield make(text, False)
    calls = answer.tool_calls()
    if calls:
        yield make("", False, calls)
    yield make("", True, **answer.timings())


async def ollama_answer(chunks: AsyncIterator, arrival: float, model: str, chat: bool) -> ChatChunk | GenerateChunk:
    """The non-streamed answer: the stream's pieces joined, its calls, and the final chunk's counters."""
    texts, calls, final = [], None, None
    async for c in ollama_stream(chunks, arrival, model, chat):
        piece = c.message if chat else c
        texts.append(piece.content if chat else piece.response)
        calls = calls or (c.message.tool_calls if chat else None)
        final = c
    text = "".join(texts)
    if chat:
        return final.model_copy(update={"message": MessageOut(content=text, tool_calls=calls)})
    return final.model_copy(update={"response": text})


async def answer(serving, request: ChatCompletionRequest | CompletionRequest, model: str, chat: bool, stream: bool,
                 is_disconnected: IsDisconnected | None):
    """Run ``request`` (a streamed OpenAI request) through ``serving`` (``OpenAIServing`` or ``ModelRouter``);
    Ollama's chunks (``chat``: ``/api/chat``'s shape, else ``/api/generate``'s) as an async iterator, or its one
    answer. ``model``: the name the client asked for, echoed in every chunk.

    Raises:
        APIError: what the serving layer refuses before the answer starts (400, 404, 429, 503); a non-streamed
            answer also what ends it (500, 504).
    """
    arrival = time.perf_counter()
    is_chat_request = isinstance(request, ChatCompletionRequest)
    handler = serving.create_chat_completion if is_chat_request else serving.create_completion
    try:
        chunks = await handler(request, is_disconnected)
        if stream:
            return ollama_stream(chunks, arrival, model, chat)
        return await ollama_answer(chunks, arrival, model, chat)
    except APIError as exc:
        raise with_ollama_names(exc) from None
