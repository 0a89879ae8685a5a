"""Celeris: a small bidirectional Llama-style transformer for masked diffusion.

The model maps token ids to logits and nothing else: no sampling, training or
compile logic lives here. Architecture (Llama, arXiv:2302.13971, made
bidirectional as in LLaDA arXiv:2502.09992): token embedding, ``num_layers``
pre-norm blocks of RMSNorm -> multi-head attention with rotary position
embeddings (RoPE, arXiv:2104.09864) -> RMSNorm -> SwiGLU MLP, a final RMSNorm,
and an output head tied to the embedding. Attention is
``scaled_dot_product_attention`` with no causal mask (``is_causal=False``), so
every position sees every other non-padding position. Setting ``is_causal`` in
the config gives the autoregressive twin with the same weights layout: causal
attention, and token i scored from the hidden state at i - 1.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from celeris.models.contract import hybrid_contract

# shared with the LLaDA and Dream formats; still importable from here
from celeris.models.layers import (
    KVCache,
    RMSNorm,
    Window,
    apply_rope,
    causal_mask,
    positions_and_mask,
    rope_cos_sin,
    scored_logits,
    update_cache,
    window_inputs,
)


@dataclass
class CelerisConfig:
    """Hyper-parameters of a Celeris model, stored as the checkpoint's ``config.json``.

    Special token ids (``mask_token_id``, ``eos_token_id``, ``pad_token_id``) come
    from the tokenizer when the checkpoint is made; code never uses literals.
    """

    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    intermediate_size: int = 704
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    mask_token_id: int = 1
    eos_token_id: int = 0
    pad_token_id: int = 2
    is_causal: bool = False
    # hybrid models (``celeris train --objective hybrid``): the length of the fully masked block the model
    # drafts after its committed tokens, attending to them and bidirectionally to itself; 0: not trained to draft
    draft_block_size: int = 0
    model_type: str = "celeris"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_json(cls, path: str | Path) -> CelerisConfig:
        """Read ``config.json``; unknown keys (e.g. ``architectures``) are ignored."""
        raw = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def to_json(self, path: str | Path) -> None:
        data = {"architectures": ["CelerisForMaskedDiffusion"], **asdict(self)}
        Path(path).write_text(json.dumps(data, indent=2) + "\n")


class Attention(nn.Module):
    def __init__(self, cfg: CelerisConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.is_causal = cfg.num_heads, cfg.head_dim, cfg.is_causal
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        cache: KVCache | None = None,
        layer_idx: int = 0,
        window: Window | None = None,
    ) -> torch.Tensor:
        b, length, _ = x.shape
        q, k, v = self.qkv_proj(x).view(b, length, 3, self.num_heads, self.head_dim).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, L, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = update_cache(k, v, cache, layer_idx, window)  # (B, H, T, D) with a window
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=self.is_causal and attn_mask is None and window is None
        )  # (B, H, L, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward (arXiv:2002.05202)."""

    def __init__(self, cfg: CelerisConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: CelerisConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None, **cache_args
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_mask, **cache_args)
        return x + self.mlp(self.mlp_norm(x))


class CelerisModel(nn.Module):
    """Token ids -> logits. See the module docstring for the architecture."""

    supports_kv_cache = True  # forward accepts cache= / window= (see KVCache)

    def __init__(self, cfg: CelerisConfig) -> None:
        super().__init__()
        self.config = cfg
        # the causal twin scores token i from the hidden state at i - 1 (next-token prediction)
        self.logits_shift = int(cfg.is_causal)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # a hybrid model also decodes by plain block diffusion (celeris.sampling.block) with this contract
        self.block_contract = (hybrid_contract(cfg.draft_block_size, cfg.mask_token_id)
                               if cfg.is_causal and cfg.draft_block_size > 0 else None)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """GPT-2 style init: N(0, std) weights, output projections scaled by 1/sqrt(2 * layers)."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                scale = (2 * self.config.num_layers) ** -0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                p.normal_(0.0, std * scale)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        window: Window | None = None,
        layout_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states.

        Args:
            input_ids: (B, T) int64 token ids (always the whole canvas).
            attention_mask: optional (B, T) bool, True for real tokens and False for
                padding. Padding keys are never attended, and positions (RoPE) count
                only real tokens, so a left-padded row computes exactly what the
                unpadded row computes.
            cache: with ``window`` None, an empty KVCache that this full pass
                fills; with ``window`` (w0, w1) or per-row columns (B, Lw) (see
                ``layers.Window``), a filled cache: only those positions are
                computed (and written back), the other keys/values come from the cache.
            layout_mask: optional (B, 1, Lq, T) bool block-diffusion layout
                (``celeris.models.contract.layout_mask``; a hybrid model's block mode),
                used instead of the causal rule and combined with the padding mask.

        Returns:
            (B, T, hidden_size), or (B, Lw, hidden_size) for a window pass,
            in the parameter dtype.
        """
        positions, attn_mask = positions_and_mask(input_ids, attention_mask)  # None mask: SDPA's fast path
        if layout_mask is not None:
            attn_mask = layout_mask if attn_mask is None else layout_mask & attn_mask
        elif self.config.is_causal and (attn_mask is not None or window is not None):
            causal = causal_mask(input_ids.shape[1], window, input_ids.device)
            attn_mask = causal if attn_mask is None else attn_mask & causal  # (B, 1, Lq, T)
        if cache is not None and window is None:
            cache.keys.clear()
            cache.values.clear()
        ids, positions = window_inputs(input_ids, positions, window)  # (B, Lq)
        return self.layout_hidden_states(ids, positions, attn_mask, cache, window)

    def layout_hidden_states(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attn_mask: torch.Tensor | None,
        cache: KVCache | None = None,
        window: Window | None = None,
    ) -> torch.Tensor:
        """The transformer on a layout the caller builds: (B, Lq) ids at (B, Lq) RoPE positions with an SDPA
        mask (B or 1, 1, Lq, T) bool (True: attend), or None for the config's own rule -> (B, Lq, d) final
        normed hidden states. ``cache``/``window`` as in ``hidden_states`` (``window`` (B, Lq) per-row columns
        or a span). The hybrid objective's two-stream layout and verified decoding's passes use it.
        """
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        x = self.embed_tokens(ids)  # (B, Lq, d)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn_mask, cache=cache, layer_idx=i, window=window)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied output head: (..., hidden_size) -> (..., vocab_size) float32 logits."""
        return F.linear(hidden, self.embed_tokens.weight).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        logits_slice: slice | None = None,
        return_hidden: bool = False,
        cache: KVCache | None = None,
        window: Window | None = None,
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T) token ids -> (B, L', vocab_size) float32 logits; row i predicts token i.

        The causal twin (``is_causal``) scores token i from the hidden state at
        i - 1, so a window pass whose scored positions start at the window's first
        column also computes the position before it (``layers.scored_logits``);
        the engine then decodes it one token per step.
        ``logits_slice`` (canvas coordinates) restricts the output head to a span
        of positions (L' is its length; it must lie inside ``window`` when one is
        given); the samplers only need logits of the block being denoised.
        ``return_hidden`` returns the hidden states instead (training computes the
        head only at masked positions). ``cache``/``window``: see ``hidden_states``;
        with per-row window columns (B, Lw), ``logits_index`` (B, L') picks
        which of them to score (default: all) and ``logits_slice`` is not used.
        """
        if return_hidden:
            return self.hidden_states(input_ids, attention_mask, cache, window)
        return scored_logits(self, input_ids, attention_mask, logits_slice, cache, window, logits_index)


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
