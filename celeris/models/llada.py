"""LLaDA: the published LLaDA-8B checkpoint format (GSAI-ML/LLaDA-8B-Base and -Instruct).

LLaDA (arXiv:2502.09992) is a Llama-3-sized transformer trained as a masked
diffusion model, so attention is bidirectional. Its checkpoints use the OLMo
module layout (``model.transformer.blocks.N.*``) with the "llama" block:
pre-norm RMSNorm -> attention with RoPE (q/k/v/attn_out projections, optional
grouped K/V heads) -> residual, then RMSNorm -> SwiGLU MLP
``ff_out(silu(ff_proj(x)) * up_proj(x))`` -> residual; a final RMSNorm
(``ln_f``) and an untied output head (``model.transformer.ff_out``).

The model maps token ids to logits and nothing else. Logits at position i
predict token i (no shift). Config keys and tensor names: ``FORMATS.md``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from celeris.models.celeris import RMSNorm, apply_rope, rope_cos_sin
from celeris.tokenizer import special_token_ids

# Checkpoint tensor name -> module name in LLaDAModel ("{i}" is the block index).
CHECKPOINT_KEYS = {
    "model.transformer.wte.weight": "embed_tokens.weight",
    "model.transformer.blocks.{i}.attn_norm.weight": "layers.{i}.attn_norm.weight",
    "model.transformer.blocks.{i}.q_proj.weight": "layers.{i}.attn.q_proj.weight",
    "model.transformer.blocks.{i}.q_proj.bias": "layers.{i}.attn.q_proj.bias",
    "model.transformer.blocks.{i}.k_proj.weight": "layers.{i}.attn.k_proj.weight",
    "model.transformer.blocks.{i}.k_proj.bias": "layers.{i}.attn.k_proj.bias",
    "model.transformer.blocks.{i}.v_proj.weight": "layers.{i}.attn.v_proj.weight",
    "model.transformer.blocks.{i}.v_proj.bias": "layers.{i}.attn.v_proj.bias",
    "model.transformer.blocks.{i}.attn_out.weight": "layers.{i}.attn.o_proj.weight",
    "model.transformer.blocks.{i}.ff_norm.weight": "layers.{i}.mlp_norm.weight",
    "model.transformer.blocks.{i}.ff_proj.weight": "layers.{i}.mlp.gate_proj.weight",
    "model.transformer.blocks.{i}.up_proj.weight": "layers.{i}.mlp.up_proj.weight",
    "model.transformer.blocks.{i}.ff_out.weight": "layers.{i}.mlp.down_proj.weight",
    "model.transformer.ln_f.weight": "norm.weight",
    "model.transformer.ff_out.weight": "lm_head.weight",
}


@dataclass
class LLaDAConfig:
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
        for bad, what in unsupported:
            if bad:
                raise ValueError(f"this LLaDA config uses {what}, which Celeris does not implement")
        if self.d_model % self.n_heads or self.n_heads % self.num_kv_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must divide by n_heads ({self.n_heads}) "
                f"and n_heads by the K/V heads ({self.num_kv_heads})"
            )
        for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")

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

    @classmethod
    def from_json(cls, path: str | Path) -> LLaDAConfig:
        """Read ``config.json``; unknown keys are ignored.

        Special ids missing from the config (or null) come from the tokenizer
        files beside it; a missing pad id falls back to the end-of-text id.

        Raises:
            ValueError: no mask id anywhere, or an unsupported setting.
        """
        path = Path(path)
        raw = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known and v is not None}
        values.update(special_token_ids(raw, path.parent))
        return cls(**values)


class Attention(nn.Module):
    """Bidirectional multi-head attention with RoPE and grouped K/V heads."""

    def __init__(self, cfg: LLaDAConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.n_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_bias = bool(cfg.include_qkv_bias)
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.num_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.num_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None
    ) -> torch.Tensor:
        b, length, _ = x.shape
        q = self.q_proj(x).view(b, length, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, D)
        k = self.k_proj(x).view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, L, D)
        v = self.v_proj(x).view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, L, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.num_kv_heads != self.num_heads:  # each K/V head serves a group of consecutive query heads
            k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)  # (B, H, L, D)
            v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False)  # (B, H, L, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward (arXiv:2002.05202): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LLaDAConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LLaDAConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_mask)
        return x + self.mlp(self.mlp_norm(x))


class LLaDAModel(nn.Module):
    """Token ids -> logits for LLaDA checkpoints. See the module docstring for the architecture."""

    def __init__(self, cfg: LLaDAConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.embedding_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.lm_head = None if cfg.weight_tying else nn.Linear(cfg.d_model, cfg.embedding_size, bias=False)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L) int64 ids (+ optional (B, L) bool mask, False on padding) -> (B, L, d_model) final normed states.

        Padding keys are never attended. RoPE positions count real tokens only;
        RoPE depends on position differences alone, so this equals the published
        model's 0..L-1 positions for every real token.
        """
        b, length = input_ids.shape
        if attention_mask is None:
            positions = torch.arange(length, device=input_ids.device).expand(b, length)
            attn_mask = None
        else:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L)
            attn_mask = attention_mask[:, None, None, :]  # (B, 1, 1, L) keys
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        x = self.embed_tokens(input_ids)  # (B, L, d)
        if self.config.input_emb_norm:
            x = x * self.config.d_model**0.5
        for layer in self.layers:
            x = layer(x, cos, sin, attn_mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., d_model) -> (..., vocab_size) float32; padded embedding rows past vocab_size are dropped."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight[: self.config.vocab_size]).float()
        return logits / math.sqrt(self.config.d_model) if self.config.scale_logits else logits

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        logits_slice: slice | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """(B, L) token ids -> (B, L', vocab_size) float32 logits; ``logits_slice`` picks the positions (L')."""
        hidden = self.hidden_states(input_ids, attention_mask)
        if return_hidden:
            return hidden
        if logits_slice is not None:
            hidden = hidden[:, logits_slice]
        return self.logits(hidden)
