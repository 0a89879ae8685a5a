"""Llama: next-token checkpoints in transformers' ``LlamaForCausalLM`` layout (Llama 2/3.x, SmolLM2, ...).

Llama (arXiv:2302.13971): pre-norm blocks of RMSNorm -> attention with RoPE and grouped K/V heads -> residual,
RMSNorm -> SwiGLU MLP -> residual; final RMSNorm; ``lm_head`` or, with ``tie_word_embeddings`` (SmolLM2, Llama
3.2 1B/3B), the embedding matrix (the folder then has no ``lm_head.weight``). Options of transformers'
``LlamaConfig``: ``attention_bias`` (biases on q, k, v and o), ``mlp_bias`` (on gate, up and down), ``head_dim``
(need not be hidden_size / heads), RoPE scaling (``rope_scaling`` / ``rope_parameters``: default, linear,
llama3 as every Llama 3.1/3.2 folder states, yarn; ``celeris.models.rope``). Causal, shifted logits, no mask
token (``celeris.models.causal``). Tensor names: ``FORMATS.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from celeris.models.causal import CausalConfig, CausalLM
from celeris.models.config import QWEN2_KEYS, QwenConfig
from celeris.models.layers import Architecture

# transformers' Llama names: Qwen2's (q/k/v biases included, used with attention_bias) plus the biases of
# o_proj and, with mlp_bias, of the MLP's projections.
LLAMA_BIASES = {
    "model.layers.{i}.self_attn.o_proj.bias": "layers.{i}.attn.o_proj.bias",
    "model.layers.{i}.mlp.gate_proj.bias": "layers.{i}.mlp.gate_up_proj.bias[gate]",
    "model.layers.{i}.mlp.up_proj.bias": "layers.{i}.mlp.gate_up_proj.bias[up]",
    "model.layers.{i}.mlp.down_proj.bias": "layers.{i}.mlp.down_proj.bias",
}
CHECKPOINT_KEYS = QWEN2_KEYS | LLAMA_BIASES


@dataclass
class LlamaConfig(CausalConfig, QwenConfig):
    """The keys of transformers' ``LlamaConfig`` (its defaults), read from config.json."""

    vocab_size: int = 32000
    intermediate_size: int = 11008
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"

    FORMAT = "Llama"

    def architecture(self) -> Architecture:
        """Causal, shifted; biases as ``attention_bias`` / ``mlp_bias`` say."""
        return super().architecture(qkv_bias=self.attention_bias, o_bias=self.attention_bias,
                                    mlp_bias=self.mlp_bias, is_causal=True, logits_shift=1)


class LlamaModel(CausalLM):
    """Token ids -> next-token logits for ``LlamaForCausalLM`` checkpoints."""
