"""The serving layer: OpenAI requests in, engine calls through AsyncEngine, OpenAI responses out.

Usable without HTTP (batch jobs reuse it)::

    serving = OpenAIServing.from_model("path/to/checkpoint")
    serving.start()
    body = serving.run_sync("/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 16})

``create_completion`` / ``create_chat_completion`` take a validated request model and return the
full response model, or (``stream: true``) an async iterator of chunk models. Admission and
validation happen before they return, so an HTTP layer can still answer 400/404/429 with a status
code; failures after that (time-out, engine error) are raised from the iterator as ``APIError``.

Streaming sends each piece of the answer as soon as it is final (``StepOutput.new_token_ids``):
``IncrementalText`` decodes the final prefix, holds back text that ends in an unfinished UTF-8
character (U+FFFD) and any tail that could begin a stop string, so the concatenated deltas equal
the non-streamed text for the same seed; both paths run the same code. That driving of a run (events in,
``Update``s out) is ``celeris.serve.runs.RunDriver``, a base of ``OpenAIServing``; this module translates
requests and shapes responses.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import fields, replace
from functools import partial
from pathlib import Path
from typing import Any

from celeris.config import SERVER_MAX_WAITING, EngineConfig
from celeris.engine import Engine, QueueFullError
from celeris.llm import LLM, ContextLengthError
from celeris.sampling.logprobs import TokenLogprob
from celeris.sampling.params import SamplingParams, rename_deprecated
from celeris.serve.async_engine import AsyncEngine, EngineDeadError, EngineInput
from celeris.serve.chat import chat_choice, chat_chunks
from celeris.serve.errors import check_token_ids, parameter_error
from celeris.serve.metrics import ServerMetrics
from celeris.serve.protocol import (
    APIError,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ModelCard,
    ModelList,
    SamplingRequest,
    UsageInfo,
    now,
    parse_request,
    random_id,
)
from celeris.serve.runs import (
    RETRY_AFTER_S,
    Choice,
    ClientDisconnected,
    IsDisconnected,
    Run,
    RunDriver,
)
from celeris.serve.scoring import (
    chat_logprobs,
    check_scoring,
    choice_logprobs,
    echo_text,
    scoring_settings,
    wants_logprobs,
)
from celeris.serve.tools import (
    chat_grammar,
    check_answer_grammar,
    declared_functions,
    response_format_grammar,
    template_messages,
    tool_mode,
)
from celeris.text import IncrementalText

__all__ = ["ClientDisconnected", "IsDisconnected", "OpenAIServing"]


def _fields(request: SamplingRequest) -> set[str]:
    """The names a 400 may give as its ``param``: the request's fields and ``SamplingParams``' (the request's
    settings map onto them one to one)."""
    return set(type(request).model_fields) | {f.name for f in fields(SamplingParams)}


class OpenAIServing(RunDriver):
    """Translates OpenAI requests into engine calls for one loaded model.

    Args:
        llm: a loaded ``celeris.llm.LLM`` (model, tokenizer, generation defaults).
        async_engine: the engine loop; built from ``llm.model`` when None.
        served_model_name: the ``model`` clients must name (default: ``llm.name``: the alias or embedded name given,
            a ``.gguf`` file's stem, else the checkpoint folder name).
        request_timeout: seconds from arrival until a request is aborted (504).
        metrics: Prometheus metrics to record into (a fresh registry when None).
        engine_config: ``max_num_seqs`` running and ``max_waiting`` queued requests at most (beyond
            that: 429), when ``async_engine`` and ``engine`` are None: an engine of its own on ``llm.model``, so
            the caller may go on using ``llm.generate``.
        engine: the engine to drive when ``async_engine`` is None, e.g. ``llm.engine`` (``from_model``: one engine
            per loaded model; the serving loop must then be that engine's only caller).
    """

    def __init__(
        self,
        llm,
        async_engine: AsyncEngine | None = None,
        served_model_name: str | None = None,
        request_timeout: float = 60.0,
        metrics: ServerMetrics | None = None,
        engine_config: EngineConfig | None = None,
        engine: Engine | None = None,
    ) -> None:
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.model_name = served_model_name or getattr(llm, "name", None) or Path(llm.path).name
        self.metrics = (metrics or ServerMetrics()).for_model(self.model_name)
        if async_engine is None:
            if engine is None:
                engine = Engine(llm.model, engine_config or EngineConfig(), llm.end_token_ids,
                                grammar_tokenizer_loader=lambda: getattr(llm, "grammar_tokenizer", None))
            # the engine's queue counts free running slots, so it admits max_num_seqs + max_waiting in all
            async_engine = AsyncEngine(engine, max_in_flight=engine.config.max_num_seqs + engine.config.max_waiting,
                                       on_stats=self.metrics.set_queue_stats)
        self.async_engine = async_engine
        self.metrics.watch_drafts(async_engine.engine)
        self.request_timeout = request_timeout
        self.context_length = llm.context_length
        self.mask_id = llm.model.config.mask_token_id
        self.eos_id = self.tokenizer.eos_token_id
        self.draining = False  # set by begin_drain: no new requests
        self.cutting_off = False  # set by cut_off: requests in flight end with 503 at their next event

    def begin_drain(self) -> None:
        """Take no new requests (503); those in flight go on (any thread)."""
        self.draining = True

    def cut_off(self) -> None:
        """End every request in flight at once with 503 ``server_shutting_down`` (any thread): a stream
        sends that error event and ``data: [DONE]``."""
        self.draining = True
        self.cutting_off = True

    @classmethod
    def from_model(
        cls,
        model: str | Path | None = None,
        *,
        max_waiting: int = SERVER_MAX_WAITING,
        request_timeout: float = 60.0,
        served_model_name: str | None = None,
        metrics: ServerMetrics | None = None,
        **llm_kwargs: Any,
    ) -> OpenAIServing:
        """Load a checkpoint (None: the embedded default model) and build its serving layer (not started).

        ``llm_kwargs`` go to ``celeris.llm.LLM``: its load options (trust_remote_code, tokenizer, chat_template)
        and any ``EngineConfig`` field (device, max_num_seqs, dtype, ...); ``max_waiting`` defaults to the
        server's bounded queue (``SERVER_MAX_WAITING``: beyond it a request gets 429). ``metrics``: a registry
        shared with other models' serving layers (``celeris serve --also-serve``).

        Raises:
            TypeError: a keyword LLM does not take. ValueError, CheckpointError: as ``LLM`` raises them.
        """
        llm = LLM(model, max_waiting=max_waiting, **llm_kwargs)
        return cls(llm, served_model_name=served_model_name, request_timeout=request_timeout, engine=llm.engine,
                   metrics=metrics)

    def start(self) -> None:
        self.async_engine.start()

    def stop(self) -> None:
        self.async_engine.stop()

    # -- endpoints --------------------------------------------------------------------------------

    def model_card(self) -> ModelCard:
        """This model's card, with its generation defaults and decoding kind (the playground reads them)."""
        from celeris.sampling.verified import draft_length

        model = self.llm.model
        kind = ("hybrid" if draft_length(model) else "autoregressive") if getattr(model.config, "is_causal", False) \
            else "diffusion"
        return ModelCard(id=self.model_name, max_model_len=self.context_length,
                         generation_config=rename_deprecated(dict(getattr(self.llm, "generation_config", {}) or {})),
                         decoding_kind=kind, checkpoint=dict(getattr(self.llm, "card", None) or {}) or None)

    def show_models(self) -> ModelList:
        return ModelList(data=[self.model_card()])

    def show_model(self, model_id: str) -> ModelCard:
        """GET /v1/models/{model_id}: the served model's card, else 404 ``model_not_found``."""
        if model_id != self.model_name:
            raise APIError(404, f"the model '{model_id}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        return self.show_models().data[0]

    async def create_completion(
        self, request: CompletionRequest, is_disconnected: IsDisconnected | None = None
    ) -> CompletionResponse | AsyncIterator[CompletionStreamResponse]:
        """POST /v1/completions: one choice per prompt and ``n``; ``suffix`` fills the gap before it."""
        arrival = time.perf_counter()
        self._check_common(request)
        check_scoring(request, bool(getattr(self.llm.model.config, "is_causal", False)))
        grammar = response_format_grammar(request.response_format)
        check_answer_grammar(grammar, getattr(self.llm, "grammar_tokenizer", None), "response_format")
        score_only = request.max_tokens == 0  # echo: the prompt alone (one engine step that decodes nothing)
        params = self._params(request, 1 if score_only else request.max_tokens, grammar)
        prompts = request.prompts()
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                check_token_ids(p, self.tokenizer.vocab_size, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        encoded = [self._encode(p, params, request.suffix, "prompt") for p in prompts]
        run = await self._start(request, encoded, arrival, is_disconnected, score_only)
        rid, created = random_id("cmpl"), now()
        echoes = [echo_text(p, self.tokenizer.decode) if request.echo else "" for p in prompts
                  for _ in range(request.n)]
        if request.stream:
            return self._completion_stream(run, request, rid, created, echoes)
        texts = await self._collect(run)
        choices = [CompletionChoice(index=i, text=echoes[i] + t, finish_reason=c.finish_reason, celeris=c.details,
                                    logprobs=self._completion_logprobs(request, run, i, c.answer_logprobs(),
                                                                       echoes[i]))
                   for i, (t, c) in enumerate(zip(texts, run.choices, strict=True))]
        return CompletionResponse(id=rid, created=created, model=self.model_name, choices=choices, usage=run.usage())

    def _completion_logprobs(self, request: CompletionRequest, run: Run, index: int,
                             answer: list[TokenLogprob | None], echo: str, offset: int = 0,
                             with_prompt: bool = True) -> CompletionLogprobs | None:
        """Choice ``index``'s completions ``logprobs`` (``celeris.serve.scoring.choice_logprobs``)."""
        choice = run.choices[index]
        prompt = run.group.inputs[index].prompt_ids if request.echo and with_prompt else None
        return choice_logprobs(request, prompt, choice.prompt_logprobs, answer, self._token_text, echo, offset)

    def _token_text(self, token_id: int) -> str:
        """One token's text alone, special tokens kept (the ``tokens`` of log-probabilities)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def create_chat_completion(
        self, request: ChatCompletionRequest, is_disconnected: IsDisconnected | None = None
    ) -> ChatCompletionResponse | AsyncIterator[ChatCompletionChunk]:
        """POST /v1/chat/completions: the conversation is rendered with the tokenizer's chat template."""
        arrival = time.perf_counter()
        self._check_common(request)
        check_scoring(request, bool(getattr(self.llm.model.config, "is_causal", False)))
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        grammar, optional = chat_grammar(request)
        field = "tool_choice" if tool_mode(request) in ("required", "named") else "response_format"
        check_answer_grammar(grammar, getattr(self.llm, "grammar_tokenizer", None),
                             "tools" if request.tools and tool_mode(request) != "none" else "response_format")
        try:
            params = self._params(request, max_tokens, grammar, field)
        except APIError:
            if not optional:
                raise
            params = self._params(request, max_tokens)  # tool_choice "auto" on a model without grammar support
        messages, tools = template_messages(request, self.tokenizer.chat_template)
        try:  # message contents are always text: a special-token string in them never becomes its id
            prompt_ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools,
                                                    **(request.chat_template_kwargs or {}))
        except Exception as exc:  # jinja2 raises TemplateError (or anything a template raises)
            raise APIError(400, f"the chat template could not render these messages: {exc}", param="messages") from None
        encoded = [self._encode(prompt_ids, params, None, "messages")]
        run = await self._start(request, encoded, arrival, is_disconnected)
        rid, created = random_id("chatcmpl"), now()
        if request.stream:
            return self._chat_stream(run, request, rid, created)
        texts = await self._collect(run)
        functions = declared_functions(request) if tool_mode(request) != "none" else {}
        choices = [chat_choice(i, t, c.finish_reason, c.details, functions)
                   for i, (t, c) in enumerate(zip(texts, run.choices, strict=True))]
        if request.logprobs:
            for choice, c in zip(choices, run.choices, strict=True):
                choice.logprobs = chat_logprobs(c.answer_logprobs(), self._token_text)
        return ChatCompletionResponse(id=rid, created=created, model=self.model_name, choices=choices,
                                      usage=run.usage())

    # -- without HTTP -----------------------------------------------------------------------------

    async def handle(self, endpoint: str, body: dict | str | bytes) -> dict:
        """Validate and run one non-streamed request; returns the OpenAI response body.

        Raises:
            APIError: any failure, with the HTTP status it would have had.
        """
        raw = body if isinstance(body, str | bytes) else json.dumps(body)
        models = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
        if endpoint not in models:
            raise APIError(404, f"unknown endpoint '{endpoint}'; use one of {', '.join(models)}", code="not_found")
        request = parse_request(models[endpoint], raw)
        if request.stream:
            raise APIError(400, "stream is not supported here; send stream: false", param="stream")
        handler = self.create_completion if endpoint == "/v1/completions" else self.create_chat_completion
        response = await handler(request)
        return response.model_dump(mode="json")

    async def respond(self, endpoint: str, body: dict | str | bytes) -> tuple[int, dict]:
        """Like ``handle`` but never raises for a failed request: returns (HTTP status, body)."""
        try:
            return 200, await self.handle(endpoint, body)
        except APIError as exc:
            return exc.status_code, exc.response().model_dump(mode="json")

    def run_sync(self, endpoint: str, body: dict | str | bytes) -> dict:
        """``handle`` for synchronous callers (not from inside a running event loop)."""
        return asyncio.run(self.handle(endpoint, body))

    # -- request translation ----------------------------------------------------------------------

    def check_model_name(self, model: str | None) -> None:
        """Raise 404 ``model_not_found`` unless ``model`` is None or this served model's name."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def _check_common(self, request: SamplingRequest) -> None:
        self.check_model_name(request.model)
        unsupported = request.unsupported_params()
        if unsupported:
            names = ", ".join(unsupported)
            raise APIError(400, f"unsupported parameter(s): {names}; Celeris does not implement them",
                           param=unsupported[0], code="unsupported_parameter")
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if request.stream_mode == "denoise" and not request.stream:
            raise APIError(400, "stream_mode 'denoise' is only allowed when stream is true", param="stream_mode")

    def _params(self, request: SamplingRequest, max_tokens: int | None, grammar: str | None = None,
                grammar_field: str = "response_format") -> SamplingParams:
        """The request's SamplingParams, with ``grammar`` (structured output, tool calls) if given; a refusal of the
        grammar names ``grammar_field``, the request field it comes from."""
        if grammar is not None and getattr(self.llm, "grammar_tokenizer", None) is None:
            raise APIError(400, "structured output (response_format, tools) is not available for this model's "
                                "tokenizer", param=grammar_field)
        try:
            params = self.llm.default_params(max_tokens=max_tokens, grammar=grammar, temperature=request.temperature,
                                             top_p=request.top_p, seed=request.seed, stop=request.stop_list() or None,
                                             **request.sampling_fields(), **scoring_settings(request))
            params = self.llm.with_special_stops(params)
            self.llm.check(params, bool(getattr(request, "suffix", None)))  # the engine's own admission check
            return params
        except (ValueError, TypeError) as exc:  # SamplingParams names the field first: "steps must be >= 1"
            raise parameter_error(exc, _fields(request), {"grammar": grammar_field}) from None

    def _encode(self, text: str | list[int], params: SamplingParams, suffix: str | None,
                param: str) -> tuple[list[int], list[int], SamplingParams]:
        """Prompt (text, or ids already encoded) and suffix ids, checked against the context window
        (``LLM.encode_prompt``), with the params to decode them with: a max_tokens the client did not send fitted
        to the room left (``LLM.fit_max_tokens``, for every API); its errors as 400s naming ``param``."""
        what = "the prompt" if param == "prompt" else "the messages (rendered with the chat template)"
        try:
            ids, suffix_ids = self.llm.encode_prompt(text, params, suffix, what)
            return ids, suffix_ids, self.llm.fit_max_tokens(params, len(ids), len(suffix_ids), what)
        except ContextLengthError as exc:
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None
        except ValueError:  # the only other refusal: nothing to condition on
            raise APIError(400, f"'{param}' must not be empty", param=param) from None

    async def _start(self, request: SamplingRequest, encoded: list[tuple[list[int], list[int], SamplingParams]],
                     arrival: float, is_disconnected: IsDisconnected | None, score_only: bool = False) -> Run:
        """Admit one engine request per (prompt, choice) with that prompt's params (``_encode``); seeds are seed,
        seed + 1, ... per prompt. ``score_only``: each scores its prompt and decodes nothing (echo, max_tokens 0)."""
        inputs = []
        for ids, suffix_ids, params in encoded:
            for j in range(request.n):
                seed = None if params.seed is None else params.seed + j
                inputs.append(EngineInput(ids, replace(params, seed=seed, stop=list(params.stop)), suffix_ids,
                                          score_only))
        if self.cutting_off:  # a request that arrived before the drain began runs, unless its period is over
            raise APIError(503, "the server is shutting down and takes no new requests; retry on another replica",
                           code="server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
        if len(inputs) > self.async_engine.max_in_flight:
            raise APIError(400, f"this request needs {len(inputs)} generations (prompts x n), more than the server "
                                f"can hold at once ({self.async_engine.max_in_flight})", param="n")
        try:
            group = await self.async_engine.submit(inputs, want_canvas=request.stream_mode == "denoise",
                                                    retryable=not request.stream)
        except QueueFullError as exc:
            self.metrics.rejected.inc()
            raise APIError(429, f"{exc}", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as exc:  # the engine's admission refused it (the same check as ``LLM.check``)
            raise parameter_error(exc, _fields(request)) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from None
        choices = [Choice(IncrementalText(partial(self.tokenizer.decode, skip_special_tokens=p.skip_special_tokens),
                                           p.stop, p.include_stop_str_in_output, p.grammar))
                   for p in (inp.params for inp in inputs)]
        prompt_tokens = sum(len(ids) + len(sfx) for ids, sfx, _ in encoded)
        for c in choices:  # completions' logprobs end with the end token's, as vLLM's (lm-evaluation-harness drops it)
            c.with_end = isinstance(request, CompletionRequest)
        return Run(group, choices, prompt_tokens, arrival, arrival + self.request_timeout, request.stream_mode,
                    is_disconnected, wants_logprobs(request))

    async def _completion_stream(self, run: Run, request: CompletionRequest, rid: str, created: int,
                                 echoes: list[str]) -> AsyncIterator[CompletionStreamResponse]:
        """The chunks of a streamed completion; an echoed prompt (``echoes``, with its logprobs) is each choice's
        first chunk."""
        def chunk(choice: CompletionChoice) -> CompletionStreamResponse:
            return CompletionStreamResponse(id=rid, created=created, model=self.model_name, choices=[choice])

        offsets = [0] * len(run.choices)  # characters of each choice's text sent so far
        started = [False] * len(run.choices)
        async for u, text, step in self._stream_pieces(run):
            if request.echo and not started[u.index]:
                echo = echoes[u.index]
                yield chunk(CompletionChoice(index=u.index, text=echo, logprobs=self._completion_logprobs(
                    request, run, u.index, [], echo)))
                offsets[u.index] = len(echo)
            started[u.index] = True
            logprobs = None if u.logprobs is None else self._completion_logprobs(
                request, run, u.index, u.logprobs, "", offsets[u.index], with_prompt=False)
            offsets[u.index] += len(text)
            yield chunk(CompletionChoice(index=u.index, text=text, finish_reason=u.finish_reason, step=step,
                                         celeris=u.details, logprobs=logprobs))
        if request.stream_options is not None and request.stream_options.include_usage:
            yield CompletionStreamResponse(id=rid, created=created, model=self.model_name, choices=[],
                                           usage=run.usage())

    async def _chat_stream(self, run: Run, request: ChatCompletionRequest, rid: str,
                           created: int) -> AsyncIterator[ChatCompletionChunk]:
        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices, usage=usage)

        mode = tool_mode(request)
        functions = declared_functions(request) if mode != "none" else {}
        constrained = run.group.inputs[0].params.grammar is not None
        fmt = partial(chat_logprobs, piece=self._token_text) if request.logprobs else None
        async for c in chat_chunks(self._stream_pieces(run), len(run.choices), mode, functions, constrained,
                                   run.stream_mode == "denoise", chunk, fmt):
            yield c
        if request.stream_options is not None and request.stream_options.include_usage:
            yield chunk([], usage=run.usage())

