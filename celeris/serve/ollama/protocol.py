"""Pydantic models of Ollama's API (the shapes of its ``docs/api.md`` and of the official ``ollama`` Python client's
``_types.py``), and Ollama's error shape ``{"error": "..."}``.

Requests are strict and forbid unknown fields, like the OpenAI routes' (``celeris.serve.protocol``): a field
Celeris would otherwise ignore is a 400, never silent. Every field Ollama documents is declared. Those that do not
change the answer (``keep_alive``, ``truncate``, the runtime options ``num_gpu``, ``num_thread``, ...) are accepted
and ignored; those Celeris cannot honour (``images``, ``template``, ``context``, ``think``, ``logprobs``,
``mirostat``, ``tfs_z``, ...) pass only at their neutral values (``unsupported``), else the serving layer answers 400.
Inside ``options`` the Celeris settings (``steps``, ``block_length``, ``remasking``, ...: every ``SamplingParams``
setting declared for HTTP) go under their Celeris names; Ollama's own names map onto them
(``celeris.serve.ollama.serving.sampling_body``).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, create_model

from celeris.serve.errors import APIError
from celeris.serve.protocol import FunctionDefinition, SamplingExtensions, StrictModel

OLLAMA_PREFIX = "/api/"
# The Ollama release whose API shapes these routes follow (GET /api/version answers it; clients gate features on it).
OLLAMA_API_VERSION = "0.12.0"
# Ollama's names for settings the OpenAI side names otherwise; the Celeris name is refused inside options.
OLLAMA_NAMES = {"repeat_penalty": "repetition_penalty"}


def is_ollama_path(path: str) -> bool:
    """True for the paths whose errors take Ollama's shape (``/api/...``)."""
    return path.startswith(OLLAMA_PREFIX)


def error_body(exc: APIError) -> dict[str, str]:
    """Ollama's error shape: ``{"error": message}`` (the status code travels in the HTTP status)."""
    return {"error": exc.message}


def error_bytes(exc: APIError) -> bytes:
    return json.dumps(error_body(exc)).encode()


def timestamp() -> str:
    """Now as Ollama writes ``created_at``: RFC 3339 in UTC, microseconds, ``Z``."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


# ---------------------------------------------------------------------------------------------
# Requests


def _celeris_options() -> dict[str, tuple[object, object]]:
    """The Celeris sampling settings allowed inside ``options`` (all of ``SamplingExtensions`` but those Ollama
    names otherwise)."""
    return {name: (field.annotation, field) for name, field in SamplingExtensions.model_fields.items()
            if name not in OLLAMA_NAMES.values()}


CelerisOptions = create_model("CelerisOptions", __base__=StrictModel, **_celeris_options())


class Options(CelerisOptions):
    """``options``: Ollama's model parameters (``docs/modelfile.md``) plus the Celeris settings.

    Mapped: ``num_predict`` (answer tokens; -1 or -2: as many as fit), ``temperature``, ``top_p``, ``top_k``,
    ``min_p``, ``seed``, ``stop``, ``repeat_penalty`` (CTRL's, Celeris's ``repetition_penalty``), ``presence_penalty``,
    ``frequency_penalty`` and ``num_ctx``
    (checked: a window larger than the served context is a 400); Celeris's ``tool_choice`` (chat). Accepted and
    ignored (runtime knobs that do not change the answer): ``numa`` .. ``num_keep``, ``penalize_newline``,
    ``mirostat_tau``, ``mirostat_eta``. Refused unless neutral: ``mirostat`` (0), ``tfs_z`` and ``typical_p`` (1),
    ``repeat_last_n`` (null).
    """

    num_predict: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None
    num_ctx: int | None = None
    # Celeris extension (/api/chat): OpenAI's tool_choice, "auto" (Ollama's behaviour, the default with tools),
    # "none", "required" (one or more calls), or a declared function's name (exactly one call of it)
    tool_choice: str | None = Field(default=None, min_length=1)
    # runtime options: no effect on the answer
    numa: bool | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None
    num_keep: int | None = None
    penalize_newline: bool | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    # sampling options Celeris does not implement: neutral values only
    mirostat: int | None = None
    tfs_z: float | None = None
    typical_p: float | None = None
    repeat_last_n: int | None = None

    def unsupported(self) -> list[str]:
        """Names of set options Celeris cannot honour (``options.<name>``)."""
        neutral = {"mirostat": (0,), "tfs_z": (1,), "typical_p": (1,), "repeat_last_n": ()}
        return [f"options.{name}" for name, ok in neutral.items() if getattr(self, name) not in (None, *ok)]

    def celeris_settings(self) -> dict[str, object]:
        """The Celeris settings that are set, by their Celeris names."""
        return {name: getattr(self, name) for name in CelerisOptions.model_fields if getattr(self, name) is not None}


Format = Literal["", "json"] | dict[str, Any]
KeepAlive = str | float | None


class _Request(StrictModel):
    """Fields shared by ``/api/generate`` and ``/api/chat``."""

    model: str = Field(min_length=1)
    stream: bool = True
    format: Format | None = None
    options: Options | None = None
    keep_alive: KeepAlive = None
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    truncate: bool | None = None
    shift: bool | None = None

    def unsupported(self) -> list[str]:
        """Names of set fields Celeris cannot honour (neutral values: null, false, 0)."""
        names = [n for n in ("think", "logprobs") if getattr(self, n) not in (None, False)]
        names += ["top_logprobs"] * (self.top_logprobs not in (None, 0))
        return names + (self.options.unsupported() if self.options is not None else [])


class GenerateRequest(_Request):
    """POST /api/generate. ``raw`` sends ``prompt`` as it is; otherwise it is the user turn of a conversation
    rendered with the model's chat template (after ``system``). ``suffix`` asks for infilling (masked-diffusion
    models). An empty ``prompt`` only loads the model (``done_reason: "load"``, or ``"unload"`` for
    ``keep_alive: 0``)."""

    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool | None = None
    context: list[int] | None = None
    images: list[str] | None = None
    width: int | None = None  # image-generation models only
    height: int | None = None
    steps: int | None = None

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        names += [n for n in ("template", "context", "images") if getattr(self, n)]
        return names + [n for n in ("width", "height", "steps") if getattr(self, n) is not None]


class ToolCallFunction(StrictModel):
    index: int | None = None
    name: str = Field(min_length=1)
    arguments: dict[str, Any]


class ToolCall(StrictModel):
    """A call in Ollama's shape: ``function.arguments`` is a JSON object, not a string."""

    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunction


class Message(StrictModel):
    """One message. A ``tool`` message carries a result; ``tool_name`` (and, in newer Ollama, ``tool_call_id``)
    tell which call it answers. ``thinking`` of earlier assistant turns is accepted and not shown to the model."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class Tool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatRequest(_Request):
    """POST /api/chat: the conversation is rendered with the model's chat template. No messages only loads the
    model (``done_reason: "load"``)."""

    messages: list[Message] = Field(default_factory=list, max_length=4096)
    tools: list[Tool] | None = Field(default=None, max_length=128)

    def unsupported(self) -> list[str]:
        return super().unsupported() + [f"messages[{i}].images" for i, m in enumerate(self.messages) if m.images]


class ShowRequest(StrictModel):
    """POST /api/show: ``model`` (older clients: ``name``)."""

    model: str | None = None
    name: str | None = None
    verbose: bool | None = None


# ---------------------------------------------------------------------------------------------
# Responses (the routes serialize them without their None fields, as Go's ``omitempty``)


class Timings(BaseModel):
    """The final chunk's counters; durations in nanoseconds. ``prompt_eval_duration``: arrival to the first
    answer text (queueing and the passes before it), ``eval_duration``: the rest; ``load_duration`` is 0 (the
    model was loaded at start)."""

    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class _GenerateHead(BaseModel):
    model: str
    created_at: str = Field(default_factory=timestamp)
    response: str = ""
    done: bool


class GenerateChunk(Timings, _GenerateHead):
    """One object of an ``/api/generate`` answer (fields in Ollama's order: the head, then the counters)."""


class MessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str = ""
    tool_calls: list[ToolCall] | None = None


class _ChatHead(BaseModel):
    model: str
    created_at: str = Field(default_factory=timestamp)
    message: MessageOut
    done: bool


class ChatChunk(Timings, _ChatHead):
    """One object of an ``/api/chat`` answer (fields in Ollama's order: the head, then the counters)."""


class ModelDetails(BaseModel):
    parent_model: str = ""
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ModelEntry(BaseModel):
    """One model of ``/api/tags`` (and, with ``expires_at``, ``size_vram``, ``context_length``, of ``/api/ps``)."""

    name: str
    model: str
    modified_at: str | None = None
    size: int
    digest: str
    details: ModelDetails
    expires_at: str | None = None
    size_vram: int | None = None
    context_length: int | None = None


class ModelList(BaseModel):
    models: list[ModelEntry]


class ShowResponse(BaseModel):
    modelfile: str
    parameters: str
    template: str
    license: str = ""
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class VersionResponse(BaseModel):
    version: str
    celeris: str
