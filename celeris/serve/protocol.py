"""Pydantic models of the OpenAI-compatible API: requests, responses and stream chunks (errors and the parsing
of a raw body into a request model: ``celeris.serve.errors``, whose names are re-exported here).

Request models are strict (a JSON string is not an integer, ``true`` is not ``1``) and forbid
unknown fields, so a parameter is never silently ignored. OpenAI parameters Celeris cannot honour
(``logit_bias``, the deprecated ``functions``, ...)
are declared so that their neutral values (null, 0, false, [])
pass; ``unsupported_params`` names those set to anything else, and the serving layer answers 400.

Celeris extensions (extra body fields of the ``openai`` client) are derived from ``SamplingParams``' declaration
(every field whose ``Setting.http`` is set: ``steps``, ``block_length``, ``top_k``, ``remasking``, ``decoding``,
``threshold``, ``cache``, ``repetition_penalty``, vLLM's ``stop_token_ids`` ... ; ``celeris.sampling.params``; OpenAI's own
``frequency_penalty`` and ``presence_penalty`` come the same way), plus
``stream_mode`` (``"text"``, or ``"denoise"``: every chunk carries the whole answer canvas). None takes the model's
``generation_config.json`` value. Their ranges and choices (the registries' keys, read at call time) are checked
by ``SamplingParams`` when the serving layer builds it, so Python, the CLI, HTTP and batch jobs refuse the same
values with the same message (400 naming the parameter); a setting that only some rules read (``threshold``
without ``decoding: "threshold"``, ...: ``celeris.sampling.params.rule_settings``) is refused with 400 naming both.
Responses carry ``choice.celeris`` (``DecodingDetails``) and ``usage.nfe``.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, model_serializer

from celeris.chat_template import check_template_kwargs
from celeris.sampling.params import declared, field_type
from celeris.serve.errors import APIError as APIError
from celeris.serve.errors import ErrorInfo as ErrorInfo
from celeris.serve.errors import ErrorResponse as ErrorResponse
from celeris.serve.errors import error_type as error_type
from celeris.serve.errors import errors_to_api_error as errors_to_api_error
from celeris.serve.errors import parse_json_body as parse_json_body
from celeris.serve.errors import parse_request as parse_request
from celeris.serve.errors import validation_error as validation_error

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[int], Field(min_length=1)]  # a prompt already encoded
# A function's name, declared in tools or called in the conversation's history (OpenAI's rule).
FunctionNameStr = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


def _json_text(text: str) -> str:
    """A history call's ``arguments``: JSON text (as the API returned it), never free text a template prints raw."""
    import json

    try:
        json.loads(text)
    except ValueError as exc:
        raise ValueError(f"must be JSON text (the arguments object as a string): {exc}") from None
    return text


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    if kwargs is not None:
        check_template_kwargs(kwargs)
    return kwargs

MAX_N = 64  # most choices per prompt one request may ask for
MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's and vLLM's bound; celeris.sampling.logprobs)
MAX_SEED = 2**63 - 1 - MAX_N  # seed + choice index must stay a valid torch seed


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------------------------------------
# Requests


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False


class JsonSchemaFormat(StrictModel):
    """``response_format.json_schema``: the schema the answer must validate against (``schema`` in JSON)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``; both JSON kinds are enforced
    by constrained decoding (``celeris.structured``), ``strict`` or not."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(StrictModel):
    name: FunctionNameStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: NonEmptyStr


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCallIn(StrictModel):
    """A history call's function: its name follows the declared names' rule and its arguments are JSON text."""

    name: FunctionNameStr
    arguments: Annotated[str, AfterValidator(_json_text)]


class ToolCallIn(StrictModel):
    """A call in an assistant message of the conversation (as the API returned it)."""

    id: NonEmptyStr
    type: Literal["function"] = "function"
    function: FunctionCallIn


def _extension_fields() -> dict[str, tuple[object, object]]:
    """One optional field per ``SamplingParams`` setting declared for HTTP (``Setting.http``); None takes the
    model's default. Types only: ranges and choices are SamplingParams' (checked when it is built)."""
    out = {}
    for name, spec in declared().items():
        if not spec.http:
            continue
        kind = field_type(name)
        if kind is list:  # stop_token_ids: ids, at most 64
            out[name] = (list[int] | None, Field(default=None, max_length=64, description=spec.help))
        else:
            out[name] = (kind | None, Field(default=None, description=spec.help))
    return out


SamplingExtensions = create_model("SamplingExtensions", __base__=StrictModel, **_extension_fields())


class SamplingRequest(SamplingExtensions):
    """Fields shared by completions and chat completions: OpenAI's, and the Celeris extensions
    (``SamplingExtensions``)."""

    model: str | None = None
    # The float settings' ranges live in SamplingParams (celeris.sampling.params), so Python, the CLI, HTTP and batch
    # jobs refuse the same values with the same message (400 naming the valid range).
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=16)] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI fields that do not change the output: accepted and ignored.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    stream_mode: Literal["text", "denoise"] = "text"

    # OpenAI parameters accepted only at their neutral values (see unsupported_params).
    logit_bias: Any = None

    def sampling_fields(self) -> dict[str, object]:
        """The Celeris extension settings as SamplingParams keywords (None: the model's default)."""
        return {name: getattr(self, name) for name in SamplingExtensions.model_fields}

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def unsupported_params(self) -> list[str]:
        """Names of set parameters Celeris cannot honour (a neutral value such as null, 0 or false passes)."""
        neutral = {"logit_bias": (None, {})}
        return [name for name, ok in neutral.items() if not _is_neutral(getattr(self, name), ok)]


def _kind(value: object) -> type:
    return float if type(value) is int else type(value)  # 0 and 0.0 are the same number; False is not


def _is_neutral(value: object, neutral: tuple) -> bool:
    # `False == 0` in Python; compare kinds too so `logprobs: 0` is still refused.
    return any(value is n or (_kind(value) is _kind(n) and value == n) for n in neutral)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. ``suffix`` asks for infilling: the answer fills the gap before it."""

    # text, texts, token ids or lists of them (OpenAI's and vLLM's shapes; ids are checked against the vocabulary
    # and the context by the serving layer)
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)]
    suffix: str | None = None
    # 0 only with echo: the prompt is scored, nothing is generated
    max_tokens: int | None = Field(default=None, ge=0)
    # the log-probability of each returned token and this many alternatives (OpenAI's legacy completions shape)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None  # the prompt comes back before the answer (scored, with logprobs: causal models)
    best_of: Any = None
    top_logprobs: Any = None  # a chat field: refused here unless neutral
    response_format: ResponseFormat | None = None  # as vLLM: JSON mode and JSON Schema on completions too

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a text, or token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def unsupported_params(self) -> list[str]:
        names = super().unsupported_params()
        if not _is_neutral(self.top_logprobs, (None, 0)):
            names.append("top_logprobs")
        if not _is_neutral(self.best_of, (None, 1)):
            names.append("best_of")
        return names


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    """One message. An assistant message may carry ``tool_calls`` (``content`` null); a ``tool`` message
    answers the call ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions: the conversation is rendered with the tokenizer's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = None  # the log-probability of each returned token (``choice.logprobs.content``)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token (with logprobs)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # extra variables for the chat template, as vLLM's field (e.g. Qwen3 / SDAR's {"enable_thinking": false})
    # (a name the renderer sets itself, ``messages``, ``tools``, ``bos_token``, ..., is refused: 400)
    chat_template_kwargs: Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)] = None
    # the deprecated function-calling fields, accepted only at their neutral values
    functions: Any = None
    function_call: Any = None

    def unsupported_params(self) -> list[str]:
        names = super().unsupported_params()
        for name, neutral in (("functions", (None, [])), ("function_call", (None, "none"))):
            if not _is_neutral(getattr(self, name), neutral):
                names.append(name)
        return names


# ---------------------------------------------------------------------------------------------
# Responses


class UsageInfo(BaseModel):
    """Token counts: ``completion_tokens`` counts only answer tokens returned (after stop strings).
    ``nfe`` (Celeris extension): the model forward passes of all choices summed (a CFG step counts 2)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    nfe: int = 0


class DecodingDetails(BaseModel):
    """Celeris extension on every choice (``choice.celeris``): how the answer was decoded.

    Attributes:
        nfe: forward passes of the model (the target, under verified decoding) for this choice (a CFG step
            counts 2).
        drafter_passes: passes of a DFlash drafter beside the target for this choice (0 without one).
        steps: denoising steps taken.
        tokens_per_forward: answer positions committed per forward pass (committed / nfe); far above
            1 means many tokens were decided by each pass (lower quality), except under ``verified``
            decoding, where every committed token is the next-token head's own choice (drafts accepted).
        block_length: tokens per semi-autoregressive block (capped at the answer length).
        cache: the KV cache mode; decoding: the commit rule; remasking: the confidence rule.
    """

    nfe: int
    drafter_passes: int = 0
    steps: int
    tokens_per_forward: float
    block_length: int
    cache: str
    decoding: str
    remasking: str


class DenoiseDetails(DecodingDetails):
    """``choice.celeris`` of a ``stream_mode: "denoise"`` chunk: the decoding details so far plus the canvas.

    Attributes:
        tokens: per answer position, the committed token's text piece (each token decoded alone), None
            while the position is masked.
        token_steps: per answer position, the value of ``steps`` after the step that committed it (1 = the
            first denoising step, or verified decoding's first pass), None while masked.
        drafts: verified decoding only: the text pieces of the drafts the next pass checks, for the
            positions right after the committed ones ([] otherwise).
    """

    tokens: list[str | None]
    token_steps: list[int | None]
    drafts: list[str] = Field(default_factory=list)


class OmitNoneExtras(BaseModel):
    """Serializes without the fields in ``omit_if_none`` when they are None (extensions stay off the wire)."""

    omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none_extras(self, handler):
        data = handler(self)
        for name in self.omit_if_none:
            if data.get(name, 0) is None:
                del data[name]
        return data


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions ``logprobs``: per token its text, log-probability (None for an echoed prompt's
    first token), the most likely tokens at its position with theirs (the token itself included, as vLLM), and
    its character offset in the choice's text."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprob):
    """One token of ``choice.logprobs.content`` (chat): its log-probability and ``top_logprobs`` alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None = None
    refusal: list[TokenLogprobOut] | None = None


class CompletionChoice(OmitNoneExtras):
    omit_if_none: ClassVar[tuple[str, ...]] = ("step", "celeris")
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # Celeris extension, stream_mode "denoise" only: the step this canvas snapshot follows.
    step: int | None = None
    # Celeris extension: how the answer was decoded (full responses, the last chunk of a choice, denoise chunks).
    celeris: DenoiseDetails | DecodingDetails | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(CompletionResponse):
    """One SSE chunk of a streamed completion (same ``object`` as the full response, as OpenAI sends)."""


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(OmitNoneExtras):
    omit_if_none: ClassVar[tuple[str, ...]] = ("tool_calls",)
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class DeltaFunctionCall(OmitNoneExtras):
    omit_if_none: ClassVar[tuple[str, ...]] = ("name", "arguments")
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OmitNoneExtras):
    """A piece of a streamed call: ``index`` in each, ``id``/``type``/``function.name`` in its first only."""

    omit_if_none: ClassVar[tuple[str, ...]] = ("id", "type")
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatChoice(OmitNoneExtras):
    omit_if_none: ClassVar[tuple[str, ...]] = ("celeris",)
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    celeris: DecodingDetails | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(OmitNoneExtras):
    omit_if_none: ClassVar[tuple[str, ...]] = ("role", "tool_calls")
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(OmitNoneExtras):
    omit_if_none: ClassVar[tuple[str, ...]] = ("step", "celeris")
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    step: int | None = None
    celeris: DenoiseDetails | DecodingDetails | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OmitNoneExtras):
    """One served model. Celeris extensions: ``generation_config`` (the settings a request without them
    gets: the checkpoint's generation_config.json, the playground's presets), ``decoding_kind``
    (``"diffusion"``, ``"autoregressive"`` or ``"hybrid"``) and ``checkpoint`` (what a converted checkpoint came
    from: a GGUF's ``format``, ``architecture``, ``context_length``, ``add_bos_token``, ``add_eos_token``,
    ``license`` and ``source`` file name)."""

    omit_if_none: ClassVar[tuple[str, ...]] = ("generation_config", "decoding_kind", "checkpoint")
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "celeris"
    max_model_len: int | None = None
    generation_config: dict | None = None
    decoding_kind: str | None = None
    checkpoint: dict | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
