"""LLaDA2.0: the published LLaDA2.0-mini / -flash checkpoint format (inclusionAI/LLaDA2.0-mini, LLaDA2MoeModelLM).

LLaDA2.0 (arXiv:2512.15745) is a Ling 2.0 mixture-of-experts transformer trained for block diffusion. Published
tensor layout (``model.*``; ``CHECKPOINT_KEYS`` maps it onto the shared ``TransformerLM``, whose fused
``qkv_proj`` takes ``query_key_value`` as is and whose ``gate_up_proj`` packs each SwiGLU's gate/up):

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
token ids to logits and nothing else; the transformer and KV-cache interface are ``TransformerLM``'s, with
``make_mlp`` giving the mixture-of-experts layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from celeris.models.config import BlockFormatConfig, QwenConfig
from celeris.models.contract import CONTRACTS
from celeris.models.layers import MLP, Architecture, TransformerLM

# Published tensor name -> module name ("{i}" layer, "{e}" expert index; "[part]" a row block of a fused
# projection, packed at load time). query_key_value already stacks queries, keys and values.
LAYER = "model.layers.{i}."
SWIGLU = {"gate_proj.weight": "gate_up_proj.weight[gate]", "up_proj.weight": "gate_up_proj.weight[up]",
          "down_proj.weight": "down_proj.weight"}
CHECKPOINT_KEYS = {
    "model.word_embeddings.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    LAYER + "input_layernorm.weight": "layers.{i}.attn_norm.weight",
    LAYER + "post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
    LAYER + "attention.query_key_value.weight": "layers.{i}.attn.qkv_proj.weight",
    LAYER + "attention.query_key_value.bias": "layers.{i}.attn.qkv_proj.bias",
    LAYER + "attention.query_layernorm.weight": "layers.{i}.attn.q_norm.weight",
    LAYER + "attention.key_layernorm.weight": "layers.{i}.attn.k_norm.weight",
    LAYER + "attention.dense.weight": "layers.{i}.attn.o_proj.weight",
    LAYER + "attention.dense.bias": "layers.{i}.attn.o_proj.bias",
    LAYER + "mlp.gate.weight": "layers.{i}.mlp.gate.weight",
    LAYER + "mlp.gate.expert_bias": "layers.{i}.mlp.gate.expert_bias",
    **{f"{LAYER}mlp.{mlp}{name}": f"layers.{{i}}.mlp.{mlp}{target}" for name, target in SWIGLU.items()
       for mlp in ("", "experts.{e}.", "shared_experts.")},
}


@dataclass
class LLaDA2Config(BlockFormatConfig, QwenConfig):
    """The keys of LLaDA2.0's ``config.json`` (``LLaDA2MoeConfig``; defaults as LLaDA2.0-mini where known, a folder's
    config states them). Refused besides ``QwenConfig``'s: a ``score_function`` other than sigmoid, experts that
    do not split into ``n_group`` groups, an odd rotary width."""

    vocab_size: int = 157184
    hidden_size: int = 2048
    intermediate_size: int = 5120
    num_hidden_layers: int = 20
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    head_dim: int | None = 128
    rope_theta: float = 600000.0
    use_qkv_bias: bool = False
    use_bias: bool = False
    partial_rotary_factor: float = 0.5
    num_experts: int = 256
    num_shared_experts: int | None = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    moe_intermediate_size: int = 512
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.5
    score_function: str = "sigmoid"
    model_type: str = "llada2_moe"

    NULLABLE = ("rope_scaling", "num_shared_experts")
    # published LLaDA2MoeConfig keys with the one value the model computes: per-head q/k RMSNorm
    # (``query_layernorm`` / ``key_layernorm``), and a head used as stored (``norm_head`` L2-normalises it)
    FIXED = {"use_qk_norm": True, "norm_head": False}
    FORMAT = "LLaDA2.0"
    CONTRACT = CONTRACTS["llada2"]

    def format_unsupported(self) -> list[tuple[bool, str]]:
        return [
            (self.score_function != "sigmoid", f"score_function '{self.score_function}' (only 'sigmoid')"),
            (self.num_experts % self.n_group != 0 or self.topk_group > self.n_group,
             f"num_experts {self.num_experts} in n_group {self.n_group} groups, topk_group {self.topk_group}"),
            (int(self.head_dim * self.partial_rotary_factor) % 2 != 0,
             f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim} (an odd rotary width)"),
        ]

    def architecture(self) -> Architecture:
        """Ling: q/k RMSNorm, RoPE on the first ``partial_rotary_factor`` of each head, optional biases."""
        return super().architecture(qk_norm=True, rotary_dim=int(self.head_dim * self.partial_rotary_factor),
                              qkv_bias=self.use_qkv_bias, o_bias=self.use_bias)


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
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        shared = cfg.num_shared_experts or 0
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * shared) if shared else None

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


class LLaDA2Model(TransformerLM):
    """Token ids -> float32 logits (unshifted) for LLaDA2.0 checkpoints; ``block_contract`` says how to decode."""

    def make_mlp(self, index: int) -> nn.Module:
        """A dense SwiGLU in the first ``first_k_dense_replace`` layers, else the sparse MoE block."""
        return super().make_mlp(index) if index < self.config.first_k_dense_replace else SparseMoE(self.config)
