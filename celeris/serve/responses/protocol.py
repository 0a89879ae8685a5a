"""Pydantic models of OpenAI's Responses API (``POST /v1/responses``): the request, its input items, the response
object and its output items, and the typed stream events.

The request is strict and forbids unknown fields, as the chat and completions requests are
(``celeris.serve.protocol``), so a field Celeris does not honour is a 400 naming it. Fields the ``openai`` client
and the ``openai-agents`` SDK send at neutral values (``include: []``, ``truncation: "disabled"``,
``reasoning: null``, ``background: false``, ``conversation: null``) are declared at those values only; a request
that sets one of them, or a built-in tool, or an input item or content part Celeris cannot render, is refused
before pydantic sees it (``refusal``), with one sentence saying why. The diffusion settings are extension fields
(``SamplingExtensions``), as on the other routes, plus ``seed``.

Source of the shapes: OpenAI's API reference for Responses and the ``openai`` package's ``types.responses``.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from celeris.serve.protocol import (
    MAX_SEED,
    DecodingDetails,
    FunctionNameStr,
    NonEmptyStr,
    OmitNoneExtras,
    SamplingExtensions,
    StrictModel,
    _json_text,
)

MAX_METADATA = 16  # OpenAI's limits on ``metadata``: 16 pairs, keys of 64 and values of 512 characters
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output")
INPUT_PART_TYPES = ("input_text", "output_text")


def item_id(prefix: str) -> str:
    """A fresh id in OpenAI's style (``resp_...``, ``msg_...``, ``fc_...``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    if value is None:
        return None
    if len(value) > MAX_METADATA:
        raise ValueError(f"at most {MAX_METADATA} key-value pairs, got {len(value)}")
    for key, text in value.items():
        if len(key) > 64 or len(text) > 512:
            raise ValueError(f"keys have at most 64 characters and values at most 512 (key '{key[:64]}')")
    return value


# ---------------------------------------------------------------------------------------------
# Input items


class InputTextPart(StrictModel):
    """``{"type": "input_text", "text": ...}`` (user, system and developer messages)."""

    type: Literal["input_text"]
    text: str


class OutputTextPart(StrictModel):
    """An assistant message's text as the API returned it; ``annotations`` and ``logprobs`` are accepted empty."""

    type: Literal["output_text"]
    text: str
    annotations: Annotated[list[Any], Field(max_length=0)] = Field(default_factory=list)
    logprobs: Annotated[list[Any], Field(max_length=0)] | None = None


ContentPart = Annotated[InputTextPart | OutputTextPart, Field(discriminator="type")]


class MessageItem(StrictModel):
    """A message: ``{"role", "content"}`` (``type`` may be left out, as in OpenAI's easy input message), or an
    output message sent back (``id``, ``status``, ``phase`` accepted)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(StrictModel):
    """A call the model made (as the API returned it): ``arguments`` is the JSON object as text."""

    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: FunctionNameStr
    arguments: Annotated[str, AfterValidator(_json_text)]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictModel):
    """The result of the call ``call_id``: text, or a list of ``input_text`` parts."""

    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str | list[InputTextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_tag(value: Any) -> str:
    # "<type> item": not an identifier, so an error's param skips it (``input[0].arguments``)
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return f"{kind} item"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message item")] | Annotated[FunctionCallItem, Tag("function_call item")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output item")],
    Discriminator(_item_tag),
]


# ---------------------------------------------------------------------------------------------
# The request


class FunctionTool(StrictModel):
    """A function tool in the Responses shape (flat: no ``function`` wrapper)."""

    type: Literal["function"]
    name: FunctionNameStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(StrictModel):
    """``tool_choice: {"type": "function", "name": ...}``: exactly one call of that function."""

    type: Literal["function"]
    name: FunctionNameStr


class TextFormat(StrictModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with ``name`` and ``schema`` (flat)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")] | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None


class ResponsesRequest(SamplingExtensions):
    """POST /v1/responses: the request, translated into a chat completion request (``convert.chat_request``).

    ``input`` is a string (one user message) or a list of items; ``instructions`` becomes the first (system)
    message; ``previous_response_id`` puts a stored response's conversation (its input and output items) before
    ``input``. Fields at a neutral value only (``include``, ``truncation``, ``reasoning``, ``background``,
    ``conversation``) are what the ``openai`` client and the ``openai-agents`` SDK send; ``prompt_cache_key``,
    ``service_tier`` and ``user`` are accepted and ignored.
    """

    model: str | None = None
    # the list first, so its errors name the item (``input[0].arguments``); "" is refused before (``_non_empty``)
    input: Annotated[list[InputItem], Field(min_length=1)] | str
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)  # Celeris extension (not in OpenAI's Responses)
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None  # None: true, OpenAI's default
    previous_response_id: NonEmptyStr | None = None
    metadata: Annotated[dict[str, str] | None, AfterValidator(_metadata)] = None
    # accepted and ignored
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    user: str | None = None
    # accepted at their neutral values only (``refusal`` explains any other)
    include: Annotated[list[str], Field(max_length=0)] | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: None = None
    background: Literal[False] | None = None
    conversation: None = None

    @field_validator("input", mode="before")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if value == "":
            raise ValueError("must not be empty")
        return value


def _refused_tool(i: int, tool: Any) -> tuple[str, str] | None:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if isinstance(kind, str) and kind != "function":
        return (f"tools[{i}].type", f"the built-in tool '{kind}' (web search, file search, computer use, ...) is "
                                    "not available: Celeris runs no tools itself; declare function tools and run "
                                    "them in the client")
    return None


def _refused_item(i: int, item: Any) -> tuple[str, str] | None:
    if not isinstance(item, dict):
        return None
    kind = item.get("type", "message")
    if isinstance(kind, str) and kind not in INPUT_ITEM_TYPES:
        return (f"input[{i}].type", f"input items of type '{kind}' are not supported; Celeris takes "
                                    f"{', '.join(INPUT_ITEM_TYPES)} items")
    parts = item.get("content") if kind == "message" else None
    for j, part in enumerate(parts if isinstance(parts, list) else []):
        ptype = part.get("type") if isinstance(part, dict) else None
        if isinstance(ptype, str) and ptype not in INPUT_PART_TYPES:
            return (f"input[{i}].content[{j}].type", f"content parts of type '{ptype}' are not supported; Celeris "
                                                     f"models read text only ({', '.join(INPUT_PART_TYPES)})")
    return None


def refusal(body: dict) -> tuple[str, str] | None:
    """(param, reason) for the first thing in a raw request body Celeris refuses with a reason of its own (a
    built-in tool, an unsupported input item or content part, ``background``, ``conversation``, a non-empty
    ``include``, ``truncation: "auto"``, ``reasoning``); None when there is none (the request model checks
    the rest)."""
    for i, tool in enumerate(body.get("tools") if isinstance(body.get("tools"), list) else []):
        if (found := _refused_tool(i, tool)) is not None:
            return found
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("type"), str) and choice["type"] != "function":
        return "tool_choice", f"tool_choice of type '{choice['type']}' is not supported; use 'auto', 'required', " \
                              "'none' or {\"type\": \"function\", \"name\": ...}"
    for i, item in enumerate(body.get("input") if isinstance(body.get("input"), list) else []):
        if (found := _refused_item(i, item)) is not None:
            return found
    reasons = {
        "background": (body.get("background") not in (None, False),
                       "background responses are not supported; send the request without background (or stream it)"),
        "conversation": (body.get("conversation") is not None,
                         "conversations are not supported; chain responses with previous_response_id"),
        "include": (body.get("include") not in (None, []),
                    "include is not supported (no logprobs, reasoning or tool results to add); send include: []"),
        "truncation": (body.get("truncation") == "auto",
                       "truncation 'auto' is not supported: a conversation longer than the context is refused with "
                       "400 context_length_exceeded; send truncation: 'disabled'"),
        "reasoning": (body.get("reasoning") is not None,
                      "reasoning is not supported: Celeris's models have no reasoning settings; send reasoning: null"),
    }
    for name, (refused, reason) in reasons.items():
        if refused:
            return name, reason
    return None


# ---------------------------------------------------------------------------------------------
# The response


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str = Field(default_factory=lambda: item_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    id: str = Field(default_factory=lambda: item_id("fc"))
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # the JSON object, as text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """Token counts; ``nfe`` (Celeris extension): the model's forward passes (a CFG step counts 2)."""

    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0
    nfe: int = 0


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseErrorInfo(BaseModel):
    code: str | None = None
    message: str


class ResponseObject(OmitNoneExtras):
    """The response (``object: "response"``), as returned, streamed in lifecycle events and stored.

    ``output_text`` is every message's text joined (the client libraries' convenience, sent for raw HTTP users);
    ``celeris`` (extension) says how the answer was decoded (``DecodingDetails``), absent until it finished.
    """

    omit_if_none: ClassVar[tuple[str, ...]] = ("celeris",)
    id: str = Field(default_factory=lambda: item_id("resp"))
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    output_text: str = ""
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    reasoning: None = None
    service_tier: str = "default"
    user: str | None = None
    usage: ResponseUsage | None = None
    celeris: DecodingDetails | None = None


# ---------------------------------------------------------------------------------------------
# Stream events (each carries ``type`` and ``sequence_number``, set by the stream)


class StreamEvent(BaseModel):
    type: str
    sequence_number: int = 0


class LifecycleEvent(StreamEvent):
    """``response.created`` / ``.in_progress`` / ``.completed`` / ``.incomplete`` / ``.failed``."""

    response: ResponseObject


class OutputItemEvent(StreamEvent):
    """``response.output_item.added`` / ``.done``."""

    output_index: int
    item: OutputItem


class ContentPartEvent(StreamEvent):
    """``response.content_part.added`` / ``.done``."""

    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText


class TextDeltaEvent(StreamEvent):
    type: str = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(StreamEvent):
    type: str = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ArgumentsDeltaEvent(StreamEvent):
    type: str = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(StreamEvent):
    type: str = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(StreamEvent):
    """A failure after the stream began (OpenAI's ``error`` event); ``response.failed`` follows it."""

    type: str = "error"
    code: str | None = None
    message: str
    param: str | None = None
