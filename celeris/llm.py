"""Offline facade mirroring vLLM: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from celeris import load
from celeris.config import OFFLINE_MAX_WAITING, resolve_max_model_len
from celeris.engine import Engine, Request
from celeris.load import (  # noqa: F401 - re-exported: the CLI, the bench and the servers name them here
    DEFAULT_MODEL,
    EMBEDDED,
    OFFLINE_MODEL,
    check_model,
    model_name,
    pairing_target,
    resolve_model,
)
from celeris.models.loader import CheckpointError, load_tokenizer
from celeris.sampling.block import contract_of
from celeris.sampling.dry import attach_vocabulary
from celeris.sampling.logprobs import TokenLogprob
from celeris.sampling.modes import (
    ContextLengthError,  # noqa: F401 - re-exported: serve/ maps it to a 400
    answer_room,
    check_fits_context,
    check_request,
)
from celeris.sampling.params import SamplingParams
from celeris.sampling.step import check_prompts
from celeris.structured.grammar import grammar_tokenizer, stops_apply
from celeris.text import cut_at_stop


@dataclass(slots=True)
class RequestOutput:
    """One answer.

    Attributes:
        text: decoded answer, cut before the first end-of-text token and the first stop string.
        token_ids: the answer's token ids (same cut).
        finish_reason: "stop" (end-of-text or a stop string), "length", or "error" (``error`` says why;
            ``error_code`` "no_progress": a denoising step committed nothing, see ``Engine.step``).
        nfe: forward passes this answer took part in (a CFG step counts 2).
        seconds: submit to full answer, in seconds.
        ttft_s: seconds until the answer's first token was final.
        steps: denoising steps taken.
        num_committed: answer positions committed (``num_committed / nfe`` tokens per forward pass).
        logprobs: with ``SamplingParams.logprobs``, one entry per id of ``token_ids`` (``TokenLogprob``: its
            log-probability and the top alternatives; ``celeris.sampling.logprobs`` says what they mean per
            decoding mode), else None.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs`` (causal models), one entry per prompt token, None
            for the first, else None.
    """

    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str
    nfe: int
    seconds: float
    ttft_s: float | None
    steps: int = 0
    num_committed: int = 0
    error_code: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    """A loaded checkpoint (model, tokenizer, default sampling settings) ready to generate.

    Args:
        model: checkpoint folder, ``.gguf`` file, embedded model name or alias (``resolve_model``); None uses the
            embedded default.
        trust_remote_code: allow a checkpoint format Celeris does not implement to run its own
            modeling code (``celeris.models.loader.load_any``).
        tokenizer: a folder holding tokenizer.json, or a tokenizer.json file, replacing the checkpoint's tokenizer
            (vLLM's ``tokenizer``); its tokenizer_config.json (special tokens, chat template) comes with it, and
            the model config's special ids fill what it leaves out. None: the checkpoint's.
        chat_template: a Jinja file (or a one-line template) replacing the tokenizer's chat template
            (``celeris.tokenizer.read_chat_template_file``). None: the tokenizer's.
        max_batch_size: deprecated alias of ``max_num_seqs``.
        **engine_kwargs: any ``celeris.config.EngineConfig`` field, each meaning what it says there (vLLM's names):
            ``max_num_seqs``, ``device``, ``dtype``, ``enforce_eager``, ``enable_prefix_caching``,
            ``max_model_len`` (requests beyond get the context-length error; ``context_length`` is the value in
            force), ``quantization`` (the drafter's linear layers too; "gguf" needs a .gguf checkpoint),
            ``quantize_lm_head``, ``logprobs_mode``, ``speculative_config`` (a DFlash drafter: the default
            decoding becomes verified decoding with ``draft_source`` ``lookup_first``), ``max_waiting``
            (default ``OFFLINE_MAX_WAITING``: offline use needs no limit; the servers set
            ``SERVER_MAX_WAITING``), ... checked by ``EngineConfig.from_kwargs``.

    Raises:
        TypeError: a keyword that is neither a load option above nor an engine setting.
        CheckpointError: the folder is missing, incomplete or inconsistent, or ``tokenizer`` does not exist.
        ValueError: ``max_model_len`` exceeds the model's context window, another setting is out of range,
            a quantization that is unknown or whose kernel does not take a layer's shape or the device
            (``celeris.models.quantize.QuantizationError``),
            a ``chat_template`` file that does not exist or does not parse, or a drafter that does not fit the
            target (``celeris.sampling.drafter.check_drafter``: the line names both sides).
    """

    def __init__(
        self, model: str | Path | None = None, *, trust_remote_code: bool = False,
        tokenizer: str | Path | None = None, chat_template: str | Path | None = None,
        max_batch_size: int | None = None, **engine_kwargs: Any,
    ) -> None:
        if max_batch_size is not None:
            warnings.warn("LLM(max_batch_size=...) is deprecated; use max_num_seqs", DeprecationWarning, stacklevel=2)
            engine_kwargs["max_num_seqs"] = max_batch_size
        engine_kwargs.setdefault("max_waiting", OFFLINE_MAX_WAITING)
        plan = load.resolve(model, engine_kwargs, tokenizer, chat_template)  # the load's steps: celeris.load
        loaded = load.read(plan, trust_remote_code)
        load.quantize(plan, loaded)
        load.place(plan, loaded)
        self.engine_config, self.name, self.device, self.dtype = plan.config, plan.name, plan.device, plan.dtype
        self.chat_by_default = plan.chat_by_default  # `celeris generate` uses the chat template
        self.model, self.proposer, self.path, self.card = loaded.model, loaded.proposer, loaded.path, loaded.card
        # the .gguf file the weights were read from (an alias's packaged file, or the path given); None for a
        # folder checkpoint. Other engines can load the same file (celeris.bench.llamacpp)
        self.gguf_path: Path | None = loaded.gguf_path
        self._gguf = loaded.gguf
        self.quantization: dict | None = loaded.quantization  # what quantization replaced (layers, bytes)
        self.prepacked = loaded.prepacked  # linear layers prepacked for oneDNN, the drafter's and the head included
        self.engine_config.max_model_len = resolve_max_model_len(
            plan.config.max_model_len, self.model.config.max_position_embeddings, self.device)
        self.tokenizer = load_tokenizer(self.path if plan.tokenizer is None else plan.tokenizer, self.model)
        if plan.tokenizer is not None and self.tokenizer.vocab_size > self.model.config.vocab_size:
            raise CheckpointError(f"tokenizer '{plan.tokenizer}' has {self.tokenizer.vocab_size} tokens, more than the "
                                  f"model's vocabulary of {self.model.config.vocab_size}")
        if plan.template is not None:
            self.tokenizer.chat_template = plan.template
        self.generation_config: dict = load.generation_defaults(plan, loaded)
        # every id that ends an answer: end-of-text, the generation config's eos_token_id list, end-of-turn
        self.end_token_ids = self.tokenizer.end_token_ids(self.path, self.generation_config)
        # DRY's sequence breakers are matched on the vocabulary's texts, decoded at the first request with DRY
        attach_vocabulary(self.model, lambda: self.tokenizer.token_texts(min(self.tokenizer.vocab_size,
                                                                             self.model.config.vocab_size)))
        self.engine = Engine(self.model, self.engine_config, self.end_token_ids,
                             grammar_tokenizer_loader=lambda: self.grammar_tokenizer)
        self.context_length = self.engine_config.max_model_len  # what a request may hold (max_model_len)
        # the loaded model's objects (modules, tensors, tokenizer tables) out of the collector's generations, as
        # vLLM's engine core and SGLang's scheduler do after start-up: a decoding step's garbage otherwise makes
        # the collector walk all of them (measured: gc 2-4% of a SmolLM2 width-1 step); no gc.collect() first
        # (84 ms of a 1 s load; what garbage the load left is small and stays)
        gc.freeze()

    @cached_property
    def grammar_tokenizer(self) -> object | None:
        """llguidance's view of the tokenizer, for requests with a grammar (structured output, tool calls): built
        at its first use (about 0.2 s for SmolLM2's 49,152 tokens, which a load that serves no grammar never pays);
        None when llguidance cannot read this tokenizer (``celeris.structured.grammar_tokenizer``)."""
        return grammar_tokenizer(self.tokenizer, self.model.config.vocab_size)

    def default_params(self, **overrides: object) -> SamplingParams:
        """SamplingParams from the model's ``generation_config.json`` with ``overrides`` applied (a block model's
        ``steps`` count per block, so a shorter answer keeps them; ``SamplingParams.from_defaults``)."""
        return SamplingParams.from_defaults(self.generation_config, per_answer_steps=contract_of(self.model) is None,
                                            **overrides)

    def check(self, params: SamplingParams, has_suffix: bool = False) -> str:
        """The decoding mode ``params`` get on this model, after the check the engine runs at admission
        (``celeris.sampling.modes.check_request``, stop ids against this tokenizer's vocabulary): what the
        server asks before it queues anything, so it repeats no rule of its own.

        Raises:
            ValueError: a setting this model's mode cannot run, or a stop token id outside the vocabulary; the
                message starts with the parameter (``celeris.serve.errors.parameter_error`` makes it a 400).
        """
        return check_request(self.model, params, has_suffix, self.tokenizer.vocab_size)

    def with_special_stops(self, params: SamplingParams) -> SamplingParams:
        """``params`` with each stop string that is exactly a special token (``"<|im_end|>"``) moved to
        ``stop_token_ids`` (special tokens never appear in the decoded text a stop string is matched against)."""
        strings, ids = self.tokenizer.split_stop(params.stop)
        if not ids:
            return params
        return replace(params, stop=strings, stop_token_ids=sorted(set(params.stop_token_ids) | set(ids)))

    def fit_max_tokens(self, params: SamplingParams, num_prompt: int, num_suffix: int = 0,
                       what: str = "the prompt") -> SamplingParams:
        """``params`` for a prompt of ``num_prompt`` (+ ``num_suffix``) tokens: a ``max_tokens`` the caller did not
        give (generation_config.json's, the block contract's or ``SamplingParams``' default) is lowered to what
        fits the context, ``min(context - prompt - suffix, default)`` as vLLM does, with a default ``steps``
        scaled to keep its tokens per step (not for a block model, whose steps count per block). A
        ``max_tokens`` the caller gave is kept (``encode_prompt`` refuses it when it does not fit). Every API
        (completions, chat, and the budget fields of APIs to come) goes through here; ``context_length`` is the
        one place the window is looked up.

        Raises:
            ContextLengthError: not one answer token fits (the message names no max_tokens; ``what`` names the
                prompt).
        """
        if "max_tokens" in params.explicit_settings:
            return params
        room = answer_room(num_prompt, num_suffix, self.context_length, what)
        if room >= params.max_tokens:
            return params
        steps = params.steps
        if "steps" not in params.explicit_settings and contract_of(self.model) is None:
            steps = -(-room * steps // params.max_tokens)
        return replace(params, max_tokens=room, steps=steps)

    def encode_prompt(self, prompt: str | list[int], params: SamplingParams, suffix: str | None = None,
                      what: str = "the prompt") -> tuple[list[int], list[int]]:
        """Tokenize (a list of ids is taken as already encoded) and check against the context window, with a
        default ``max_tokens`` fitted to it (``fit_max_tokens``, whose params the caller then decodes with). The
        mask and pad strings in the text are encoded as text, never as their reserved ids (``Tokenizer.encode``).

        Raises:
            ValueError: an empty prompt; ContextLengthError (a ValueError) naming every count when prompt, suffix
                and a ``max_tokens`` the caller gave do not fit, or when not one answer token fits (``what`` names
                the prompt in that message).
        """
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompts([ids])
        suffix_ids = self.tokenizer.encode(suffix, add_special_tokens=False) if suffix else []  # continues the text
        fitted = self.fit_max_tokens(params, len(ids), len(suffix_ids), what)
        check_fits_context(len(ids), len(suffix_ids), fitted.max_tokens, self.context_length, what)
        return ids, suffix_ids

    def finish(self, token_ids: list[int], params: SamplingParams, hit_eos: bool) -> tuple[str, list[int], str]:
        """Apply stop strings: returns (text, token_ids, finish_reason). The text keeps special tokens when
        ``params.skip_special_tokens`` is False and the matched stop string when ``include_stop_str_in_output``.
        Under a grammar, stop strings end only free text (``celeris.structured.grammar.stops_apply``)."""
        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, params.skip_special_tokens)

        stops = params.stop
        if stops and params.grammar is not None and stops_apply(params.grammar, decode(token_ids)) is False:
            stops = []
        text, token_ids, stopped = cut_at_stop(decode, token_ids, stops, params.include_stop_str_in_output)
        return text, token_ids, "stop" if stopped or hit_eos else "length"

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | None = None,
        suffixes: list[str | None] | None = None,
        on_step: Callable[[torch.Tensor], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate one answer per prompt (a string, or a list of token ids such as ``Tokenizer.encode_chat``
        returns), in order.

        Raises:
            ValueError: an empty prompt or one that does not fit the context window.
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = self.with_special_stops(params or self.default_params())
        suffixes = suffixes or [None] * len(prompts)
        encoded = [self.encode_prompt(p, params, s) for p, s in zip(prompts, suffixes, strict=True)]
        requests = [self.engine.add_request(ids, self.fit_max_tokens(params, len(ids), len(suffix_ids)), suffix_ids)
                    for ids, suffix_ids in encoded]
        while any(not r.is_finished for r in requests):
            self.engine.step()
            if on_step is not None:
                on_step(torch.stack([r.answer for r in requests]))
        return [self.to_output(p if isinstance(p, str) else self.tokenizer.decode(p), r)
                for p, r in zip(prompts, requests, strict=True)]

    def reset_prefix_cache(self) -> bool:
        """Empty the engine's prefix caches, as vLLM's ``LLM.reset_prefix_cache`` does (benchmarks call it so that
        a prompt seen before is not timed from its cached keys/values). Returns True."""
        return self.engine.reset_prefix_cache()

    def to_output(self, prompt: str, request: Request) -> RequestOutput:
        """Decode a finished request into a RequestOutput (stop strings applied)."""
        ids = request.final_prefix()
        text, ids, reason = self.finish(ids, request.params, request.finish_reason == "stop")
        if request.finish_reason == "error":
            reason = "error"
        end = request.finish_time or time.perf_counter()
        ttft = request.first_token_time - request.arrival_time if request.first_token_time else None
        committed = int((request.answer != request.mask_id).sum())
        logprobs = None if request.params.logprobs is None else [request.logprob_entries.get(i) for i in
                                                                  range(len(ids))]
        return RequestOutput(prompt, text, ids, reason, request.nfe, end - request.arrival_time, ttft,
                             request.num_steps, committed, request.error_code, request.error, logprobs,
                             request.prompt_logprob_entries)
