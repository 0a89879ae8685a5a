"""EngineConfig: settings of one engine instance (device, batching budgets, queue)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# weight-only quantization methods (EngineConfig.quantization, vLLM's --quantization; celeris.models.quantize)
QUANTIZATION_METHODS = ("int8", "int4", "int4-g64", "int4-g128", "gguf")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # EngineConfig.logprobs_mode (celeris.sampling.logprobs)
CPU_MAX_MODEL_LEN = 4096  # default cap of max_model_len on a CPU: the KV store of 8 rows stays a few hundred MiB


@dataclass(slots=True)
class EngineConfig:
    """Engine-wide settings.

    Attributes:
        max_num_seqs: most requests denoised together in one forward pass.
        max_num_batched_tokens: most canvas tokens (batch rows x padded length,
            CFG rows included) one forward pass may process.
        max_waiting: most requests queued before ``add_request`` raises QueueFullError.
        device: "cpu", "cuda", ...; None picks CUDA when available.
        dtype: "float32", "bfloat16" or "float16"; None picks bfloat16 on a CUDA
            device that supports it and float32 otherwise.
        enforce_eager: True runs the model eagerly; False wraps it in
            ``torch.compile`` (the runner pads canvases to buckets of
            ``length_bucket`` tokens so few shapes are compiled).
        length_bucket: canvas lengths are padded up to a multiple of this.
        enable_prefix_caching: verified decoding reuses the keys/values of prompt prefixes other requests
            prefilled (automatic prefix caching, vLLM's name; ``celeris.engine.kv``).
        max_model_len: most tokens (prompt + answer) one request may hold (vLLM's name); the KV store is sized
            from it (``max_num_seqs`` rows of it, K/V heads). None: the model's context window, capped at
            ``CPU_MAX_MODEL_LEN`` on a CPU (``resolve_max_model_len``).
        quantization: weight-only quantization of every linear layer after load (vLLM's name;
            ``celeris.models.quantize``): "int8" (per output channel), "int4" (groups of 32 input columns),
            "int4-g64", "int4-g128", or "gguf" (a GGUF checkpoint: each tensor at its block type's width);
            None keeps the loaded dtype. The KV cache stays in ``dtype``.
        quantize_lm_head: quantize the output head too (tied or not); False keeps it in ``dtype``.
        logprobs_mode: what ``SamplingParams.logprobs`` reports (vLLM's ``--logprobs-mode``): "raw_logprobs", the
            model's distribution before any processing, or "processed_logprobs", the one the token was drawn from
            (``celeris.sampling.logprobs``).
    """

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 16384
    max_waiting: int = 256
    device: str | None = None
    dtype: str | None = None
    enforce_eager: bool = True
    length_bucket: int = 32
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    quantization: str | None = None
    quantize_lm_head: bool = False
    logprobs_mode: str = "raw_logprobs"

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
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head needs a quantization (e.g. --quantization int8)")


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
