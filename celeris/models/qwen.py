"""Qwen2 / Qwen2.5 and Qwen3: next-token checkpoints in transformers' ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``
layouts (plain ``model_type`` "qwen2" / "qwen3"; the diffusion conversions SDAR, Fast-dLLM v2 and Dream have
their own formats).

The Llama layout with Qwen's options (``celeris.models.config.QwenConfig``): Qwen2 puts biases on the q, k and v
projections; Qwen3 has none (unless ``attention_bias``: then q, k, v and o) and RMS-normalises each head's
queries and keys before RoPE (``q_norm`` / ``k_norm``). RoPE scaling as Llama's (Qwen2.5's long-context folders
state ``yarn``). Causal, shifted logits, no mask token (``celeris.models.causal``). Sliding windows are refused.
Tensor names: ``FORMATS.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from celeris.models.causal import CausalConfig, CausalLM
from celeris.models.config import QWEN2_KEYS, QWEN3_KEYS, QwenConfig
from celeris.models.layers import Architecture

QWEN3_BIASES = {f"model.layers.{{i}}.self_attn.{p}_proj.bias": f"layers.{{i}}.attn.qkv_proj.bias[{p}]"
                for p in "qkv"} | {"model.layers.{i}.self_attn.o_proj.bias": "layers.{i}.attn.o_proj.bias"}
QWEN2_CHECKPOINT_KEYS = QWEN2_KEYS
QWEN3_CHECKPOINT_KEYS = QWEN3_KEYS | QWEN3_BIASES


def sliding_windows(layer_types: list | None) -> list[tuple[bool, str]]:
    """A refusal of ``layer_types`` entries other than ``full_attention`` (transformers 5 lists one per layer)."""
    windows = sorted({t for t in layer_types or [] if t != "full_attention"})
    return [(bool(windows), f"sliding-window attention (layer_types {windows})")]


@dataclass
class Qwen2Config(CausalConfig, QwenConfig):
    """The keys of transformers' ``Qwen2Config`` (its defaults), read from config.json."""

    num_key_value_heads: int | None = 32
    layer_types: list | None = None
    model_type: str = "qwen2"

    FORMAT = "Qwen2"

    def unsupported(self) -> list[tuple[bool, str]]:
        return sliding_windows(self.layer_types)

    def architecture(self) -> Architecture:
        """Biases on q/k/v; causal, shifted."""
        return super().architecture(qkv_bias=True, is_causal=True, logits_shift=1)


@dataclass
class Qwen3Config(CausalConfig, QwenConfig):
    """The keys of transformers' ``Qwen3Config`` (its defaults), read from config.json."""

    num_key_value_heads: int | None = 32
    head_dim: int | None = 128
    attention_bias: bool = False
    layer_types: list | None = None
    model_type: str = "qwen3"

    FORMAT = "Qwen3"

    def unsupported(self) -> list[tuple[bool, str]]:
        return sliding_windows(self.layer_types)

    def architecture(self) -> Architecture:
        """Per-head q/k RMSNorm; biases on q/k/v/o only with ``attention_bias``; causal, shifted."""
        return super().architecture(qk_norm=True, qkv_bias=self.attention_bias, o_bias=self.attention_bias,
                                    is_causal=True, logits_shift=1)


class Qwen2Model(CausalLM):
    """Token ids -> next-token logits for ``Qwen2ForCausalLM`` checkpoints."""


class Qwen3Model(CausalLM):
    """Token ids -> next-token logits for ``Qwen3ForCausalLM`` checkpoints."""
