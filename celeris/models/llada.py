"""LLaDA: the published LLaDA-8B checkpoint format (GSAI-ML/LLaDA-8B-Base and -Instruct).

LLaDA (arXiv:2502.09992) is a Llama-3-sized transformer trained as a masked
diffusion model, so attention is bidirectional. Its checkpoints use the OLMo
module layout (``model.transformer.blocks.N.*``) with the "llama" block:
pre-norm RMSNorm -> attention with RoPE (q/k/v/attn_out projections, optional
grouped K/V heads) -> residual, then RMSNorm -> SwiGLU MLP
``ff_out(silu(ff_proj(x)) * up_proj(x))`` -> residual; a final RMSNorm
(``ln_f``) and an untied output head (``model.transformer.ff_out``).

The model maps token ids to logits and nothing else. Logits at position i
predict token i (no shift). The transformer and the KV-cache interface (``cache=`` /
``window=``) are the shared ones of ``celeris.models.layers`` (q/k/v and
ff_proj/up_proj packed into its fused projections at load time); this file
holds the config and the name table.
Config keys and tensor names: ``FORMATS.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from celeris.models.config import FormatConfig
from celeris.models.layers import Architecture, TransformerLM

# Checkpoint tensor name -> module name in LLaDAModel ("{i}" is the block index; "[part]" a row block of a
# fused projection, packed at load time).
CHECKPOINT_KEYS = {
    "model.transformer.wte.weight": "embed_tokens.weight",
    "model.transformer.blocks.{i}.attn_norm.weight": "layers.{i}.attn_norm.weight",
    "model.transformer.blocks.{i}.q_proj.weight": "layers.{i}.attn.qkv_proj.weight[q]",
    "model.transformer.blocks.{i}.q_proj.bias": "layers.{i}.attn.qkv_proj.bias[q]",
    "model.transformer.blocks.{i}.k_proj.weight": "layers.{i}.attn.qkv_proj.weight[k]",
    "model.transformer.blocks.{i}.k_proj.bias": "layers.{i}.attn.qkv_proj.bias[k]",
    "model.transformer.blocks.{i}.v_proj.weight": "layers.{i}.attn.qkv_proj.weight[v]",
    "model.transformer.blocks.{i}.v_proj.bias": "layers.{i}.attn.qkv_proj.bias[v]",
    "model.transformer.blocks.{i}.attn_out.weight": "layers.{i}.attn.o_proj.weight",
    "model.transformer.blocks.{i}.ff_norm.weight": "layers.{i}.mlp_norm.weight",
    "model.transformer.blocks.{i}.ff_proj.weight": "layers.{i}.mlp.gate_up_proj.weight[gate]",
    "model.transformer.blocks.{i}.up_proj.weight": "layers.{i}.mlp.gate_up_proj.weight[up]",
    "model.transformer.blocks.{i}.ff_out.weight": "layers.{i}.mlp.down_proj.weight",
    "model.transformer.ln_f.weight": "norm.weight",
    "model.transformer.ff_out.weight": "lm_head.weight",
}


@dataclass
class LLaDAConfig(FormatConfig):
    """The keys of LLaDA's ``config.json`` (field names and defaults of the published ``ModelConfig``).

    Only the variant the released checkpoints use is supported (``block_type``
    "llama", RMS norms with weights and no biases, SwiGLU via ``activation_type``
    "silu", RoPE); any other setting is refused in ``__post_init__`` rather than
    computed wrongly. ``embedding_size`` (the embedding rows, may be padded past
    ``vocab_size``) defaults to ``vocab_size``; ``n_kv_heads`` None means
    ``n_heads`` (1 with ``multi_query_attention``).
    """

    d_model: int = 768
    n_heads: int = 12
    n_kv_heads: int | None = None
    n_layers: int = 12
    mlp_ratio: int = 4
    mlp_hidden_size: int | None = None
    activation_type: str = "swiglu"
    block_type: str = "sequential"
    block_group_size: int = 1
    alibi: bool = False
    rope: bool = False
    rope_theta: float = 10000.0
    multi_query_attention: bool | None = None
    attention_layer_norm: bool = False
    input_emb_norm: bool = False
    layer_norm_type: str = "default"
    layer_norm_with_affine: bool = True
    rms_norm_eps: float = 1e-5
    include_bias: bool = False
    include_qkv_bias: bool | None = False
    bias_for_layer_norm: bool | None = None
    scale_logits: bool = False
    vocab_size: int = 50257
    embedding_size: int | None = None
    weight_tying: bool = True
    max_sequence_length: int = 1024
    mask_token_id: int = -1
    eos_token_id: int = -1
    pad_token_id: int = -1
    model_type: str = "llada"

    FORMAT = "LLaDA"
    FIXED = {"clip_qkv": None}  # the published ModelConfig clamps queries, keys and values when it is set

    def __post_init__(self) -> None:
        self.embedding_size = self.embedding_size or self.vocab_size
        unsupported = [
            (self.block_type != "llama", f"block_type '{self.block_type}' (only 'llama')"),
            (self.layer_norm_type != "rms", f"layer_norm_type '{self.layer_norm_type}' (only 'rms')"),
            (self.activation_type != "silu", f"activation_type '{self.activation_type}' (only 'silu')"),
            (not self.rope or self.alibi, "position encoding other than RoPE (rope must be true, alibi false)"),
            (self.attention_layer_norm, "attention_layer_norm (QK norm)"),
            (self.include_bias or bool(self.bias_for_layer_norm), "include_bias / bias_for_layer_norm"),
            (not self.layer_norm_with_affine, "layer_norm_with_affine false"),
            (self.block_group_size != 1, f"block_group_size {self.block_group_size} (only 1)"),
        ]
        self.validate(unsupported, {"d_model": self.d_model, "n_heads": self.n_heads, "K/V heads": self.num_kv_heads})

    @property
    def num_kv_heads(self) -> int:
        if self.n_kv_heads is not None:
            return self.n_kv_heads
        return 1 if self.multi_query_attention else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def intermediate_size(self) -> int:
        return self.mlp_hidden_size if self.mlp_hidden_size is not None else self.mlp_ratio * self.d_model

    @property
    def max_position_embeddings(self) -> int:
        return self.max_sequence_length

    def architecture(self) -> Architecture:
        """The "llama" block: optional q/k/v biases, no shift."""
        return Architecture(vocab_size=self.vocab_size, embedding_rows=self.embedding_size, hidden_size=self.d_model,
                            num_layers=self.n_layers, num_heads=self.n_heads, num_kv_heads=self.num_kv_heads,
                            head_dim=self.head_dim, intermediate_size=self.intermediate_size,
                            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                            qkv_bias=bool(self.include_qkv_bias), tie_head=self.weight_tying)


class LLaDAModel(TransformerLM):
    """Token ids -> logits for LLaDA checkpoints. See the module docstring for the architecture.

    ``confidence_from`` names the published sampler's confidence rule for the sampler
    (``celeris.sampling.step.denoise_step``): LLaDA's ``generate()`` ranks positions by
    ``softmax(logits)`` over the whole vocabulary, the mask token included.
    """

    confidence_from = "unfiltered"

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, L) ids -> (B, L, d_model); scaled by sqrt(d_model) with ``input_emb_norm``."""
        x = self.embed_tokens(input_ids)
        return x * self.config.d_model**0.5 if self.config.input_emb_norm else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., d_model) -> (..., vocab_size) float32; padded embedding rows past vocab_size are dropped."""
        logits = super().logits(hidden)
        return logits / math.sqrt(self.config.d_model) if self.config.scale_logits else logits
