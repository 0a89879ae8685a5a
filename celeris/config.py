"""EngineConfig: settings of one engine instance (device, batching budgets, queue), each declared once."""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# weight-only quantization methods (EngineConfig.quantization, vLLM's --quantization; celeris.models.quantize)
QUANTIZATION_METHODS = ("int8", "int4", "int4-g64", "int4-g128", "fp8", "gguf", "q8_0", "none")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # EngineConfig.logprobs_mode (celeris.sampling.logprobs)
CPU_MAX_MODEL_LEN = 4096  # default cap of max_model_len on a CPU: the KV store of 8 rows stays a few hundred MiB


OFFLINE_MAX_WAITING = 1 << 30  # LLM(...): offline use queues without limit
SERVER_MAX_WAITING = 64  # celeris serve, OpenAIServing.from_model, Ray Serve: beyond this a request gets 429


def _knob(default: object, help: str, **cli: object) -> Any:  # noqa: A002 - argparse's word
    """A field of ``EngineConfig`` with its help text (and any CLI spelling: ``flag``, ``metavar``, ``choices``,
    ``invert``) as metadata, read by ``celeris.cli``'s flag builder and by Ray Serve's ``ServeArgs``. ``help``
    says what the flag does: for an ``invert`` field (a switch that sets a True default False) that is the
    switch's meaning."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(slots=True)
class EngineConfig:
    """Engine-wide settings, each declared once here: its default, and its help text as field metadata (the CLI
    flags, ``LLM(**engine_kwargs)``, the server, Ray Serve's ``ServeArgs`` and the batch runners read these
    fields; ``engine_fields()`` lists them, ``from_kwargs`` checks a dict of them).

    Attributes:
        max_num_seqs: most requests denoised together in one forward pass, and the rows of the engine's one KV
            store (``celeris.engine.kv.KVStore``; a CFG request with a cache takes two).
        max_num_batched_tokens: most columns one step computes, as each request's mode counts them (masked
            diffusion: batch rows x padded length, CFG rows included); a prompt that does not fit is prefilled in
            chunks where its mode allows (``celeris.engine.scheduler``).
        max_waiting: most requests queued before ``add_request`` raises QueueFullError (``LLM`` defaults it
            to ``OFFLINE_MAX_WAITING``, the servers to ``SERVER_MAX_WAITING``).
        device: "cpu", "cuda", ...; None picks CUDA when available.
        dtype: "float32", "bfloat16" or "float16"; None picks bfloat16 on a CUDA
            device that supports it and float32 otherwise.
        enforce_eager: True runs the model eagerly; False wraps it in
            ``torch.compile`` (the runner pads canvases to buckets of
            ``length_bucket`` tokens so few shapes are compiled).
        length_bucket: with ``enforce_eager`` False, canvas lengths are padded up to a multiple of this (eager
            passes are never padded: padding only saves compiles).
        enable_prefix_caching: verified decoding and a causal model's next-token decoding (``delayed`` cache)
            reuse the keys/values of prompt prefixes other requests prefilled (automatic prefix caching, vLLM's
            name; the engine's one ``celeris.engine.kv.PrefixCache``).
        max_model_len: most tokens (prompt + answer) one request may hold (vLLM's name); the KV store is sized
            from it (``max_num_seqs`` rows of it, K/V heads). None: the model's context window, capped at
            ``CPU_MAX_MODEL_LEN`` on a CPU (``resolve_max_model_len``).
        quantization: weight-only quantization of every linear layer after load (vLLM's name;
            ``celeris.models.quantize``): "int8" (per output channel), "int4" (groups of 32 input columns),
            "int4-g64", "int4-g128", or "gguf" (a GGUF checkpoint: each tensor at its block type's width);
            None keeps the loaded dtype. The KV cache stays in ``dtype``.
        quantize_lm_head: quantize the output head too (tied or not); False keeps it in ``dtype``.
        onednn: on a CPU with float32 weights and eager, run every float32 linear layer (the head included; under
            int8/int4 without ``quantize_lm_head`` the float head alone) through oneDNN with its weight reordered once
            at load (``celeris.models.prepack``); False keeps PyTorch's default matmul.
        logprobs_mode: what ``SamplingParams.logprobs`` reports (vLLM's ``--logprobs-mode``): "raw_logprobs", the
            model's distribution before any processing, or "processed_logprobs", the one the token was drawn from
            (``celeris.sampling.logprobs``).
        speculative_config: a DFlash drafter beside a causal target (vLLM's name), a dict or its JSON string
            ``{"method": "dflash", "model": PATH, "num_speculative_tokens": k}``; parsed and loaded by ``LLM``
            (``celeris.sampling.drafter.SpeculativeConfig``). None: no drafter.
    """

    max_num_seqs: int = _knob(8, "requests denoised together in one forward pass; also the rows of the KV store "
                              "(a CFG request with a cache takes two)")
    max_num_batched_tokens: int = _knob(16384, "most canvas tokens (rows x padded length) one step may "
                                        "process; a longer causal prompt is prefilled in chunks")
    max_waiting: int = _knob(256, "requests queued beyond the running ones; more get 429 (QueueFullError)")
    device: str | None = _knob(None, "cpu, cuda, cuda:1 ... (default: cuda when available)")
    dtype: str | None = _knob(None, "weight dtype (default: bfloat16 on CUDA, float32 on CPU)", choices=tuple(DTYPES))
    enforce_eager: bool = _knob(True, "torch.compile the model (slow first request)", flag="--compile", invert=True)
    length_bucket: int = _knob(32, "with --compile: canvas lengths are padded up to a multiple of this (few "
                                "compiled shapes; eager passes are never padded)")
    enable_prefix_caching: bool = _knob(True, "verified and next-token decoding recompute every prompt (no reuse of shared "
                                        "prompt prefixes' keys/values)", flag="--no-enable-prefix-caching",
                                        invert=True)
    max_model_len: int | None = _knob(None, "most tokens (prompt + answer) one request may hold; sizes the KV "
                                      f"store (default: the model's context window, at most {CPU_MAX_MODEL_LEN} "
                                      "on a CPU)")
    quantization: str | None = _knob(None, "quantization of every linear layer after load (weight-only; fp8: W8A8): "
                                     + ", ".join(QUANTIZATION_METHODS) + " (int4: groups of 32 input columns; q8_0: "
                                     "GGUF Q8_0 blocks on the CPU's block kernel and fast pass, any float checkpoint; "
                                     "none: the checkpoint's own weights, where its celeris.json names a CPU "
                                     "quantization; "
                                     "the KV cache stays in --dtype; docs/quantization.md)", metavar="METHOD")
    quantize_lm_head: bool = _knob(False, "with --quantization: quantize the output head too (default: kept in "
                                   "--dtype)")
    onednn: bool = _knob(True, "CPU, float32 weights: PyTorch's default matmul instead of oneDNN with weights "
                         "prepacked at load (celeris.models.prepack: the same numbers up to float rounding, faster "
                         "at every width, and a verified pass of several columns costs little more than one)",
                         flag="--no-onednn", invert=True)
    logprobs_mode: str = _knob("raw_logprobs", "what logprobs report (vLLM's flag): the model's distribution "
                               "(default), or the one each token was drawn from, after penalties, filters and "
                               "temperature", choices=LOGPROBS_MODES)
    speculative_config: dict | str | None = _knob(None, "a DFlash drafter beside the target (vLLM's spelling): "
                                                  '\'{"method": "dflash", "model": PATH, '
                                                  '"num_speculative_tokens": K}\'', metavar="JSON")

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}; got '{self.logprobs_mode}'")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got '{self.dtype}'")
        if self.length_bucket < 1:
            raise ValueError(f"length_bucket must be >= 1, got {self.length_bucket}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        check_quantization(self.quantization)
        if self.quantization == "none":  # asked for explicitly: no checkpoint's CPU quantization applies
            self.quantization = None
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head needs a quantization (e.g. --quantization int8)")

    @classmethod
    def from_kwargs(cls, **engine_kwargs: object) -> EngineConfig:
        """An ``EngineConfig`` from keyword arguments (``LLM(**engine_kwargs)`` and every front end's way in).

        Raises:
            TypeError: a name that is not an engine setting (the line lists those there are).
            ValueError: a value out of range (``__post_init__``'s line naming the field).
        """
        unknown = sorted(set(engine_kwargs) - set(engine_fields()))
        if unknown:
            raise TypeError(f"unknown engine setting(s) {', '.join(unknown)}; EngineConfig has "
                            f"{', '.join(engine_fields())}")
        return cls(**engine_kwargs)  # type: ignore[arg-type]


def engine_fields() -> dict[str, Field]:
    """Every engine setting by name, in declaration order: ``dataclasses.Field`` objects whose ``metadata``
    holds ``help`` (and, where the CLI spells it otherwise, ``flag``/``invert``/``metavar``/``choices``)."""
    return {f.name: f for f in fields(EngineConfig)}


def check_quantization(name: str | None) -> None:
    """Refuse a quantization method Celeris does not have (one line listing those it has).

    Raises:
        ValueError: ``name`` is not None and not in ``QUANTIZATION_METHODS``.
    """
    if name is not None and name not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization '{name}'; Celeris has {', '.join(QUANTIZATION_METHODS)}")


def resolve_max_model_len(requested: int | None, context: int, device: torch.device | str) -> int:
    """The tokens one request may hold: ``requested``, or the model's ``context`` window (capped at
    ``CPU_MAX_MODEL_LEN`` on a CPU, where a long context's KV store would not fit a laptop's memory).

    Raises:
        ValueError: ``requested`` exceeds ``context`` (named both), or is below 1.
    """
    if requested is None:
        return min(context, CPU_MAX_MODEL_LEN) if torch.device(device).type == "cpu" else context
    if requested < 1:
        raise ValueError(f"max_model_len must be >= 1, got {requested}")
    if requested > context:
        raise ValueError(f"max_model_len {requested} exceeds this model's context window of {context} tokens "
                         f"(max_position_embeddings); use at most {context}")
    return requested


def resolve_device(device: str | None) -> torch.device:
    """The given device, or CUDA when available, else CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """The given dtype name, or bfloat16 on a CUDA device that supports it, else float32."""
    if dtype is not None:
        return DTYPES[dtype]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32
