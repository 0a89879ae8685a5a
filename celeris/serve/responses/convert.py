"""Responses <-> chat completions: a Responses request becomes the chat completion request the chat route takes
(so validation, limits, errors, metrics, structured output and tool calls go through the one existing path), and
a chat answer becomes the response's output items.

Input items map onto chat messages as the ``openai-agents`` SDK maps them (``agents.models.chatcmpl_converter``):
``instructions`` is the first (system) message; a ``message`` item is a message of its role with its text parts
joined; ``function_call`` items are the ``tool_calls`` of one assistant message (joined to the assistant
message right before them, if any); a ``function_call_output`` is a ``tool`` message answering ``call_id``.
"""

from __future__ import annotations

import re
import time

from celeris.serve.protocol import APIError, ChatCompletionResponse, DecodingDetails, SamplingExtensions, UsageInfo
from celeris.serve.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    MessageItem,
    NamedFunctionChoice,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)

Item = MessageItem | FunctionCallItem | FunctionCallOutputItem

# chat request field -> the Responses field a client sent (for the param and message of a refusal)
CHAT_TO_RESPONSES = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens",
                     "max_tokens": "max_output_tokens"}
_CHAT_NAMES = re.compile(r"\b(" + "|".join(CHAT_TO_RESPONSES) + r")\b")


def input_items(request: ResponsesRequest) -> list[Item]:
    """``input`` as a list of items (a string is one user message)."""
    if isinstance(request.input, str):
        return [MessageItem(role="user", content=request.input)]
    return list(request.input)


def chat_messages(instructions: str | None, items: list[Item]) -> list[dict]:
    """The chat ``messages`` for ``instructions`` and the conversation ``items`` (module docstring)."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def chat_body(request: ResponsesRequest, items: list[Item]) -> dict:
    """The chat completion request body (JSON-ready) for ``request`` over the whole conversation ``items``
    (a stored conversation's items, then ``input``'s)."""
    body: dict = {"model": request.model, "messages": chat_messages(request.instructions, items),
                  "max_completion_tokens": request.max_output_tokens, "temperature": request.temperature,
                  "top_p": request.top_p, "seed": request.seed, "parallel_tool_calls": request.parallel_tool_calls,
                  "stream": request.stream, **{name: getattr(request, name) for name in SamplingExtensions.model_fields}}
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    if request.tools is not None:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in request.tools]
    choice = request.tool_choice
    if choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                       "function": {"name": choice.name}}
    fmt = request.text.format if request.text is not None else None
    if request.tools and (choice == "required" or isinstance(choice, NamedFunctionChoice)):
        fmt = None  # the answer is calls only, so the format of a message cannot apply (OpenAI accepts both)
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.name is None:
            missing = "schema" if fmt.json_schema is None else "name"
            raise APIError(400, f"text.format of type 'json_schema' needs {missing}", param=f"text.format.{missing}",
                           code="missing_required_parameter")
        schema = {"name": fmt.name, "schema": fmt.json_schema, "description": fmt.description, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": {k: v for k, v in schema.items()
                                                                          if v is not None}}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    return {k: v for k, v in body.items() if v is not None}


def responses_error(exc: APIError) -> APIError:
    """A refusal of the chat path, naming the Responses fields (``input``, ``text.format``, ``max_output_tokens``,
    ``tools[i].parameters``) instead of the chat fields the request was translated into."""
    param = exc.param
    if param is not None:
        head = re.split(r"[.\[]", param, maxsplit=1)[0]
        if head in CHAT_TO_RESPONSES:
            param = CHAT_TO_RESPONSES[head] + param[len(head):]
        param = re.sub(r"^(tools\[\d+\])\.function\.", r"\1.", param).replace("text.format.json_schema.",
                                                                                "text.format.")
    message = _CHAT_NAMES.sub(lambda m: CHAT_TO_RESPONSES[m.group(1)], exc.message)
    message = message.replace("text.format.json_schema.", "text.format.")
    message = message.replace("the messages (rendered", "the input (rendered")
    return APIError(exc.status_code, message, type=exc.type, param=param, code=exc.code, headers=exc.headers)


def output_items(chat: ChatCompletionResponse) -> list[OutputItem]:
    """The output items of a chat answer: one ``function_call`` per tool call, else one message."""
    choice = chat.choices[0]
    if choice.message.tool_calls:
        return [OutputFunctionCall(call_id=c.id, name=c.function.name, arguments=c.function.arguments)
                for c in choice.message.tool_calls]
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    return [OutputMessage(status=status, content=[OutputText(text=choice.message.content or "")])]


def as_input_items(output: list[OutputItem]) -> list[Item]:
    """Output items as the input items that send them back (a stored conversation's continuation)."""
    items: list[Item] = []
    for o in output:
        if isinstance(o, OutputFunctionCall):
            items.append(FunctionCallItem(type="function_call", call_id=o.call_id, name=o.name,
                                          arguments=o.arguments))
        else:
            items.append(MessageItem(role="assistant", content="".join(p.text for p in o.content)))
    return items


def base_response(request: ResponsesRequest, model: str) -> ResponseObject:
    """The response for ``request`` before any output (status ``in_progress``), echoing its settings."""
    choice = request.tool_choice
    text = {"format": request.text.format.model_dump(by_alias=True, exclude_none=True)} \
        if request.text is not None and request.text.format is not None else {"format": {"type": "text"}}
    return ResponseObject(
        created_at=int(time.time()), status="in_progress", model=model, instructions=request.instructions,
        max_output_tokens=request.max_output_tokens, temperature=request.temperature, top_p=request.top_p,
        tools=[t.model_dump(exclude_none=True) for t in request.tools or []],
        tool_choice=(choice if isinstance(choice, str) else choice.model_dump()) if choice is not None else "auto",
        parallel_tool_calls=request.parallel_tool_calls is not False, text=text,
        previous_response_id=request.previous_response_id, store=request.store is not False, metadata=request.metadata or {},
        user=request.user)


def finish(response: ResponseObject, output: list[OutputItem], usage: UsageInfo | None,
           details: DecodingDetails | None, truncated: bool) -> ResponseObject:
    """``response`` finished with ``output``: ``completed``, or ``incomplete`` (``max_output_tokens``) when the
    token budget ran out (``truncated``), with usage, ``output_text`` and the decoding details."""
    usage = usage or UsageInfo()
    return response.model_copy(update={
        "status": "incomplete" if truncated else "completed", "completed_at": int(time.time()), "output": output,
        "output_text": "".join(p.text for o in output if isinstance(o, OutputMessage) for p in o.content),
        "incomplete_details": IncompleteDetails() if truncated else None, "celeris": details,
        "usage": ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                               total_tokens=usage.total_tokens, nfe=usage.nfe)})


def response_from_chat(response: ResponseObject, chat: ChatCompletionResponse) -> ResponseObject:
    """``response`` finished with the (non-streamed) chat answer ``chat``."""
    choice = chat.choices[0]
    return finish(response.model_copy(update={"model": chat.model}), output_items(chat), chat.usage,
                  choice.celeris, choice.finish_reason == "length")
