"""Dream: the published Dream-v0 checkpoint format (Dream-org/Dream-v0-Base-7B and -Instruct-7B).

Dream (arXiv:2508.15487) is Qwen2.5-7B turned into a masked diffusion model:
the Qwen2 module layout (``model.layers.N.*``) with bidirectional attention.
Each layer: RMSNorm (``input_layernorm``) -> attention with RoPE, biases on the
q/k/v projections and grouped K/V heads -> residual, then RMSNorm
(``post_attention_layernorm``) -> SwiGLU MLP -> residual; a final RMSNorm and
an output head (``lm_head``, tied to the embedding when
``tie_word_embeddings``).

Dream keeps the autoregressive habit of predicting the *next* token: the hidden
state at position i-1 scores token i. ``forward`` applies that shift
(``logits[i] = head(h[i-1])``, position 0 keeps ``head(h[0])``, as Dream's own
sampler does), so the sampler sees "logits at position i predict token i" like
every other Celeris model. Config keys and tensor names: ``FORMATS.md``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from celeris.models.celeris import RMSNorm, apply_rope, rope_cos_sin
from celeris.tokenizer import special_token_ids

# Checkpoint tensor name -> module name in DreamModel ("{i}" is the layer index).
CHECKPOINT_KEYS = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attn.q_proj.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "layers.{i}.attn.q_proj.bias",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attn.k_proj.weight",
    "model.layers.{i}.self_attn.k_proj.bias": "layers.{i}.attn.k_proj.bias",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attn.v_proj.weight",
    "model.layers.{i}.self_attn.v_proj.bias": "layers.{i}.attn.v_proj.bias",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attn.o_proj.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.gate_proj.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.up_proj.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.down_proj.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


@dataclass
class DreamConfig:
    """The keys of Dream's ``config.json`` (field names and defaults of the published ``DreamConfig``).

    ``num_key_value_heads`` None means ``num_attention_heads``. Only plain RoPE
    (``rope_scaling`` null), SiLU and no sliding window are supported; anything
    else is refused in ``__post_init__`` rather than computed wrongly.
    """

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    use_sliding_window: bool = False
    mask_token_id: int = -1
    eos_token_id: int = -1
    pad_token_id: int = -1
    model_type: str = "Dream"

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        unsupported = [
            (self.hidden_act != "silu", f"hidden_act '{self.hidden_act}' (only 'silu')"),
            (self.rope_scaling is not None, f"rope_scaling {self.rope_scaling} (only plain RoPE)"),
            (self.use_sliding_window, "use_sliding_window"),
        ]
        for bad, what in unsupported:
            if bad:
                raise ValueError(f"this Dream config uses {what}, which Celeris does not implement")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must divide by num_attention_heads ({self.num_attention_heads}) "
                f"and that by num_key_value_heads ({self.num_key_value_heads})"
            )
        for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, path: str | Path) -> DreamConfig:
        """Read ``config.json``; unknown keys are ignored.

        Special ids missing from the config (or null) come from the tokenizer
        files beside it; a missing pad id falls back to the end-of-text id.

        Raises:
            ValueError: no mask id anywhere, or an unsupported setting.
        """
        path = Path(path)
        raw = json.loads(path.read_text())
        known = {f.name for f in fields(cls)} - {"rope_scaling"}
        values = {k: v for k, v in raw.items() if k in known and v is not None}
        values["rope_scaling"] = raw.get("rope_scaling")
        values.update(special_token_ids(raw, path.parent))
        return cls(**values)


class Attention(nn.Module):
    """Bidirectional attention with RoPE, q/k/v biases and grouped K/V heads."""

    def __init__(self, cfg: DreamConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=True)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)

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

    def __init__(self, cfg: DreamConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: DreamConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_mask)
        return x + self.mlp(self.mlp_norm(x))


class DreamModel(nn.Module):
    """Token ids -> (shifted) logits for Dream checkpoints. See the module docstring for the architecture."""

    def __init__(self, cfg: DreamConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L) int64 ids (+ optional (B, L) bool mask, False on padding) -> (B, L, hidden_size) final normed states.

        Padding keys are never attended and RoPE positions count real tokens only,
        as Dream's sampler does for padded batches (cumulative sum of the mask).
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
        for layer in self.layers:
            x = layer(x, cos, sin, attn_mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output head: (..., hidden_size) -> (..., vocab_size) float32 logits (no shift)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        logits_slice: slice | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """(B, L) token ids -> (B, L', vocab_size) float32 logits where row i predicts token i.

        ``logits_slice`` picks the output positions (L' of them); each is scored
        from the hidden state one to its left (position 0 from itself).
        ``return_hidden`` returns the unshifted (B, L, hidden_size) states.
        """
        hidden = self.hidden_states(input_ids, attention_mask)
        if return_hidden:
            return hidden
        positions = torch.arange(hidden.shape[1], device=hidden.device)
        if logits_slice is not None:
            positions = positions[logits_slice]
        source = (positions - 1).clamp(min=0)  # (L',) the hidden state that predicts each output position
        return self.logits(hidden[:, source])
