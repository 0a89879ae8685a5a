"""LLaDA2.0: the published LLaDA2.0-mini / -flash checkpoint format (inclusionAI/LLaDA2.0-mini, LLaDA2MoeModelLM).

LLaDA2.0 (arXiv:2512.15745) is a Ling 2.0 mixture-of-experts transformer trained for block diffusion. Module
layout (``model.*``, the published names, mirrored here so the name table is the identity):

- ``model.word_embeddings``; per layer ``input_layernorm`` (RMSNorm) -> ``attention``: one fused
  ``query_key_value`` projection ((H + 2 H_kv) x head_dim rows: queries, keys, values), per-head RMSNorm of
  queries and keys (``query_layernorm`` / ``key_layernorm``), RoPE on the first ``partial_rotary_factor`` of
  each head's dimensions, grouped K/V heads, output projection ``dense`` -> residual;
  ``post_attention_layernorm`` -> ``mlp`` -> residual; ``model.norm``, ``lm_head``.
- ``mlp`` is a dense SwiGLU (``gate_proj`` / ``up_proj`` / ``down_proj``) in the first
  ``first_k_dense_replace`` layers, else a sparse MoE block: the router ``gate`` (``weight`` (E, d) and the
  ``expert_bias`` buffer) scores experts by sigmoid(x W^T) in float32; the top ``num_experts_per_tok`` are chosen
  from scores + expert_bias among the ``topk_group`` best of ``n_group`` expert groups (a group's score: the sum
  of its two best); their weights are the chosen sigmoid scores normalised to sum 1 (when more than one) times
  ``routed_scaling_factor``; output = sum_k w_k expert_k(x) + ``shared_experts``(x) (a SwiGLU of
  ``moe_intermediate_size * num_shared_experts``).

Logits are not shifted; attention at inference is block-causal over blocks of 32 (the published
``generate``'s ``tril(ones(nb, nb))`` block mask). Decoding contract: ``CONTRACTS["llada2"]``. The model maps
token ids to logits and nothing else; the KV-cache interface is ``TransformerLM``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from celeris.models.contract import CONTRACTS
from celeris.models.layers import (
    KVCache,
    RMSNorm,
    Window,
    apply_rope,
    positions_and_mask,
    rope_cos_sin,
    update_cache,
    window_inputs,
)
from celeris.models.sdar import BlockFormatConfig

# The module tree mirrors the published names: the table is the identity ("{i}" layer, "{e}" expert index).
CHECKPOINT_KEYS = {name: name for name in (
    "model.word_embeddings.weight", "model.norm.weight", "lm_head.weight",
    "model.layers.{i}.input_layernorm.weight", "model.layers.{i}.post_attention_layernorm.weight",
    "model.layers.{i}.attention.query_key_value.weight", "model.layers.{i}.attention.query_key_value.bias",
    "model.layers.{i}.attention.query_layernorm.weight", "model.layers.{i}.attention.key_layernorm.weight",
    "model.layers.{i}.attention.dense.weight", "model.layers.{i}.attention.dense.bias",
    "model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight",
    "model.layers.{i}.mlp.down_proj.weight", "model.layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.gate.expert_bias",
    "model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    "model.layers.{i}.mlp.experts.{e}.down_proj.weight", "model.layers.{i}.mlp.shared_experts.gate_proj.weight",
    "model.layers.{i}.mlp.shared_experts.up_proj.weight", "model.layers.{i}.mlp.shared_experts.down_proj.weight",
)}


@dataclass
class LLaDA2Config(BlockFormatConfig):
    """The keys of LLaDA2.0's ``config.json`` (``LLaDA2MoeConfig``; defaults as LLaDA2.0-mini where known, a folder's
    config states them). Refused: ``rope_scaling``, an activation other than SiLU, a ``score_function`` other than
    sigmoid, experts that do not split into ``n_group`` groups."""

    vocab_size: int = 157184
    hidden_size: int = 2048
    intermediate_size: int = 5120
    num_hidden_layers: int = 20
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    head_dim: int | None = 128
    hidden_act: str = "silu"
    use_qkv_bias: bool = False
    use_bias: bool = False
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 600000.0
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 0.5
    max_position_embeddings: int = 32768
    num_experts: int = 256
    num_shared_experts: int | None = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    moe_intermediate_size: int = 512
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.5
    score_function: str = "sigmoid"
    mask_token_id: int = -1
    eos_token_id: int = -1
    pad_token_id: int = -1
    model_type: str = "llada2_moe"

    NULLABLE = ("rope_scaling", "num_shared_experts")
    FORMAT = "LLaDA2.0"
    CONTRACT = CONTRACTS["llada2"]

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        unsupported = [
            (self.hidden_act != "silu", f"hidden_act '{self.hidden_act}' (only 'silu')"),
            (self.rope_scaling is not None, f"rope_scaling {self.rope_scaling} (only plain RoPE)"),
            (self.score_function != "sigmoid", f"score_function '{self.score_function}' (only 'sigmoid')"),
            (self.num_experts % self.n_group != 0 or self.topk_group > self.n_group,
             f"num_experts {self.num_experts} in n_group {self.n_group} groups, topk_group {self.topk_group}"),
            (int(self.head_dim * self.partial_rotary_factor) % 2 != 0,
             f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim} (an odd rotary width)"),
        ]
        self.validate(unsupported, {"num_attention_heads * head_dim": self.num_attention_heads * self.head_dim,
                                    "num_attention_heads": self.num_attention_heads,
                                    "num_key_value_heads": self.num_key_value_heads})


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``: (..., d) -> (..., d)."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """The MoE gate: group-limited top-k over sigmoid scores with an expert bias (module docstring)."""

    def __init__(self, cfg: LLaDA2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, d) -> chosen experts (N, k) int64 and their weights (N, k) float32."""
        cfg = self.cfg
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))  # (N, E), float32 as published
        routing = scores + self.expert_bias.float()
        groups = routing.view(x.shape[0], cfg.n_group, -1)  # (N, G, E/G)
        best_groups = groups.topk(2, dim=-1).values.sum(-1).topk(cfg.topk_group, dim=-1).indices  # (N, topk_group)
        keep = torch.zeros(x.shape[0], cfg.n_group, dtype=torch.bool, device=x.device).scatter_(1, best_groups, True)
        routing = routing.masked_fill(~keep[:, :, None].expand_as(groups).reshape_as(routing), float("-inf"))
        chosen = routing.topk(cfg.num_experts_per_tok, dim=-1).indices  # (N, k)
        weights = scores.gather(1, chosen)
        if cfg.num_experts_per_tok > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return chosen, weights * cfg.routed_scaling_factor


class SparseMoE(nn.Module):
    """Routed experts plus shared experts: (B, L, d) -> (B, L, d)."""

    def __init__(self, cfg: LLaDA2Config) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        shared = cfg.num_shared_experts or 0
        self.shared_experts = SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, d)
        chosen, weights = self.gate(flat)  # (N, k)
        out = torch.zeros(flat.shape, dtype=torch.float32 if flat.dtype != torch.float64 else flat.dtype,
                          device=flat.device)
        for e in chosen.unique().tolist():  # each used expert on the tokens that chose it
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](flat[rows]).to(out.dtype) * weights[rows, slot, None].to(out.dtype))
        out = out.to(x.dtype).view_as(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class Attention(nn.Module):
    """Fused q/k/v projection, per-head q/k RMSNorm, partial RoPE, grouped K/V heads, ``dense`` output."""

    def __init__(self, cfg: LLaDA2Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rope_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.query_key_value = nn.Linear(cfg.hidden_size, rows, bias=cfg.use_qkv_bias)
        self.query_layernorm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.key_layernorm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.dense = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.use_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None,
                cache: KVCache | None = None, layer_idx: int = 0, window: Window | None = None) -> torch.Tensor:
        """x (B, L, d); cos/sin (B, 1, L, rope_dim); ``cache``/``window`` as ``layers.update_cache``."""
        b, length, _ = x.shape
        qkv = self.query_key_value(x).view(b, length, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        q, k = self.query_layernorm(q).transpose(1, 2), self.key_layernorm(k).transpose(1, 2)  # (B, H, L, D)
        v = v.transpose(1, 2)
        r = self.rope_dim  # RoPE on the first r dimensions of each head, the rest passes through
        q = torch.cat([apply_rope(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = torch.cat([apply_rope(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        k, v = update_cache(k, v, cache, layer_idx, window)
        if self.num_kv_heads != self.num_heads:
            k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
            v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, H, L, D)
        return self.dense(out.transpose(1, 2).reshape(b, length, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LLaDA2Config, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        dense = index < cfg.first_k_dense_replace
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size) if dense else SparseMoE(cfg)

    @property
    def attn(self) -> Attention:  # the name the engine's KV pool reads the head shape from
        return self.attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None,
                **cache_args: object) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x), cos, sin, attn_mask, **cache_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: LLaDA2Config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LLaDA2Model(nn.Module):
    """Token ids -> float32 logits (unshifted) for LLaDA2.0 checkpoints; ``block_contract`` says how to decode."""

    supports_kv_cache = True
    logits_shift = 0

    def __init__(self, cfg: LLaDA2Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.block_contract = CONTRACTS["llada2"]

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      cache: KVCache | None = None, window: Window | None = None,
                      layout_mask: torch.Tensor | None = None) -> torch.Tensor:
        """As ``TransformerLM.hidden_states``: (B, T) ids -> (B, T or Lw, d) final normed hidden states."""
        positions, attn_mask = positions_and_mask(input_ids, attention_mask)
        if layout_mask is not None:
            attn_mask = layout_mask if attn_mask is None else layout_mask & attn_mask
        if cache is not None and window is None:
            cache.keys.clear()
            cache.values.clear()
        ids, positions = window_inputs(input_ids, positions, window)
        cos, sin = rope_cos_sin(positions, int(self.config.head_dim * self.config.partial_rotary_factor),
                                self.config.rope_theta)
        x = self.model.word_embeddings(ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, attn_mask, cache=cache, layer_idx=i, window=window)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (..., vocab_size) float32."""
        weight = self.model.word_embeddings.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                logits_slice: slice | None = None, **_: object) -> torch.Tensor:
        """(B, T) ids -> (B, L', V) float32 logits over ``logits_slice`` (default all) with full attention; block
        decoding goes through ``hidden_states(..., layout_mask=...)`` (``celeris.sampling.block``)."""
        hidden = self.hidden_states(input_ids, attention_mask)
        return self.logits(hidden if logits_slice is None else hidden[:, logits_slice])
