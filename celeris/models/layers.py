"""Building blocks shared by the native model formats (Celeris, LLaDA, Dream).

All three are Llama-style transformers (arXiv:2302.13971) used bidirectionally
for masked diffusion (LLaDA arXiv:2502.09992, Dream arXiv:2508.15487): pre-norm
blocks of RMSNorm -> attention with rotary position embeddings -> residual,
RMSNorm -> SwiGLU MLP -> residual. This module holds the pieces that do not
depend on a checkpoint's naming:

- ``RMSNorm``, ``rope_cos_sin`` / ``apply_rope`` and ``KVCache`` (also used by
  ``CelerisModel``, which keeps its own fused ``qkv_proj`` / ``gate_up_proj``
  layout and re-exports these names from ``celeris.models.celeris``);
- ``Attention`` (separate q/k/v/o projections, optional q/k/v biases, grouped
  K/V heads), ``MLP`` (SwiGLU with gate/up/down projections) and ``Block``;
- ``TransformerLM``: embedding -> blocks -> final norm -> output head, with the
  KV-cache interface of ``CelerisModel`` (``cache=`` / ``window=``), for the
  published LLaDA and Dream formats;
- ``FormatConfig``: ``config.json`` reading shared by their config classes.

Module names (``embed_tokens``, ``layers.N.attn.q_proj``, ``layers.N.mlp.gate_proj``,
``norm``, ``lm_head`` ...) are what each format's ``CHECKPOINT_KEYS`` table
renames the published tensor names to; changing one here means changing those
tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from celeris.tokenizer import special_token_ids


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (arXiv:1910.07467); computed in float32.

    ``x / sqrt(mean(x^2, -1) + eps) * weight`` for x (..., dim); returns x's dtype.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables (RoPE, arXiv:2104.09864): integer ``positions`` (B, L) -> cos, sin each (B, 1, L, head_dim), float32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[..., None] * inv_freq  # (B, L, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B, L, head_dim)
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, L, D) by the half-split RoPE convention used by Llama."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


@dataclass
class KVCache:
    """Keys and values of every layer from one full forward pass, each (B, H_kv, T, head_dim).

    H_kv is the number of K/V heads (before grouped-query sharing; the query
    heads for Celeris). Used for Fast-dLLM's approximate caching of
    bidirectional models (arXiv:2505.22618, Sec. 3.2): a full pass at a block
    boundary fills the cache; the following denoising steps recompute only a
    window of positions (the current block and everything after it for the
    prefix cache, just the block for the dual cache) and read the other
    positions' keys and values from here. A window pass writes its fresh
    keys/values back, which is also what autoregressive decoding of a causal
    model needs (window = the newest token).
    """

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)


def positions_and_mask(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RoPE positions (B, T) and the SDPA key mask (B, 1, 1, T) bool, or None without padding.

    With ``attention_mask`` (B, T) bool (False on padding), positions count real
    tokens only (cumulative sum of the mask), so a left-padded row computes what
    the unpadded row computes; RoPE depends only on position differences, so
    this equals the published models' 0..T-1 positions for every real token.
    """
    b, length = input_ids.shape
    if attention_mask is None:  # no padding: SDPA's unmasked fast path
        return torch.arange(length, device=input_ids.device).expand(b, length), None
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
    return positions, attention_mask[:, None, None, :]  # (B, 1, 1, T) keys


Window = tuple[int, int] | torch.Tensor
"""Positions a cached pass computes: a span (w0, w1) shared by every row, or per-row
columns as a (B, Lw) int64 tensor (a row may repeat its last column as padding: the
repeats compute the same keys/values and their outputs are ignored)."""


def window_inputs(
    input_ids: torch.Tensor, positions: torch.Tensor, window: Window | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (B, Lq) ids and RoPE positions a pass computes: all T, a span, or per-row columns."""
    if window is None:
        return input_ids, positions
    if isinstance(window, torch.Tensor):
        return input_ids.gather(1, window), positions.gather(1, window)
    w0, w1 = window
    return input_ids[:, w0:w1], positions[:, w0:w1]


def column_window(columns: list[list[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """Per-row column lists -> a (B, Lw) int64 ``Window``, each row padded by repeating its last column."""
    width = max(len(c) for c in columns)
    return torch.tensor([c + c[-1:] * (width - len(c)) for c in columns], device=device)


def gather_positions(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, L, d) hidden states, (B, L') int64 index into L -> (B, L', d)."""
    return hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))


def causal_mask(length: int, window: Window | None, device: torch.device) -> torch.Tensor:
    """Causal query/key mask for the queries a pass computes: (Lq, T) bool, or (B, 1, Lq, T) for per-row columns."""
    keys = torch.arange(length, device=device)
    if isinstance(window, torch.Tensor):
        return (keys[None, None, :] <= window[:, :, None])[:, None]
    w0, w1 = window if window is not None else (0, length)
    return keys[None, :] <= torch.arange(w0, w1, device=device)[:, None]


def update_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache | None,
    layer_idx: int,
    window: Window | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys/values to attend to, given its fresh ones ``k``, ``v`` (B, H_kv, L, D).

    No cache: ``k``, ``v`` unchanged. A cache and no window (full pass): they
    are appended as layer ``layer_idx`` and returned. A window (w0, w1) with
    L = w1 - w0, or per-row columns (B, L): they overwrite those positions of
    the cached layer (written back: the next window pass, or an autoregressive
    step, sees them) and the whole cached (B, H_kv, T, D) keys/values are returned.
    """
    if cache is None:
        return k, v
    if window is None:  # full pass: fill the cache
        cache.keys.append(k)
        cache.values.append(v)
        return k, v
    if isinstance(window, torch.Tensor):  # per-row columns: scatter along the sequence dimension
        index = window[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        cache.keys[layer_idx].scatter_(2, index, k)
        cache.values[layer_idx].scatter_(2, index, v)
        return cache.keys[layer_idx], cache.values[layer_idx]
    w0, w1 = window  # window pass: fresh keys/values inside the window, cached ones outside
    cache.keys[layer_idx][:, :, w0:w1] = k
    cache.values[layer_idx][:, :, w0:w1] = v
    return cache.keys[layer_idx], cache.values[layer_idx]


class Attention(nn.Module):
    """Bidirectional attention with RoPE, separate q/k/v/o projections and grouped K/V heads.

    Llama's attention (arXiv:2302.13971) with grouped-query K/V heads (GQA,
    arXiv:2305.13245: query head h reads K/V head ``h // (num_heads //
    num_kv_heads)``) and, optionally, biases on q/k/v (Qwen2, as in Dream;
    LLaDA's ``include_qkv_bias``). The output projection has no bias. ``head_dim`` may be given (Qwen3
    states it; default hidden_size // num_heads) and ``qk_norm_eps`` adds Qwen3's per-head RMSNorm of the
    queries and keys before RoPE (``q_norm`` / ``k_norm``, as SDAR).
    Shapes: x (B, L, hidden) -> (B, L, hidden); q (B, H, L, D), k/v (B, H_kv, L, D).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, qkv_bias: bool = False,
                 head_dim: int | None = None, qk_norm_eps: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim or hidden_size // num_heads
        # Qwen3 / SDAR: RMSNorm over each head's queries and keys before RoPE (``q_norm`` / ``k_norm``)
        self.q_norm = RMSNorm(self.head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(self.head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        cache: KVCache | None = None,
        layer_idx: int = 0,
        window: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """x (B, L, hidden), cos/sin (B, 1, L, D), attn_mask broadcastable to (B, H, L, T) bool or None.

        ``cache``, ``layer_idx``, ``window``: see ``update_cache``; with a window
        (L = w1 - w0) the queries attend to all T cached positions.
        """
        b, length, _ = x.shape
        q = self.q_proj(x).view(b, length, self.num_heads, self.head_dim)  # (B, L, H, D)
        k = self.k_proj(x).view(b, length, self.num_kv_heads, self.head_dim)  # (B, L, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, L, D), (B, Hkv, L, D)
        v = self.v_proj(x).view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, L, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = update_cache(k, v, cache, layer_idx, window)  # (B, Hkv, T, D) with a window
        if self.num_kv_heads != self.num_heads:  # each K/V head serves a group of consecutive query heads
            k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)  # (B, H, T, D)
            v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False)  # (B, H, L, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward (arXiv:2002.05202): ``down(silu(gate(x)) * up(x))``, (..., hidden) -> (..., hidden)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block (Llama): ``x += attn(attn_norm(x)); x += mlp(mlp_norm(x))``, (B, L, hidden)."""

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int, eps: float, qkv_bias: bool,
        head_dim: int | None = None, qk_norm: bool = False,
    ) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(hidden_size, eps)
        self.attn = Attention(hidden_size, num_heads, num_kv_heads, qkv_bias, head_dim, eps if qk_norm else None)
        self.mlp_norm = RMSNorm(hidden_size, eps)
        self.mlp = MLP(hidden_size, intermediate_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None, **cache_args
    ) -> torch.Tensor:
        """``cache_args``: ``cache``, ``layer_idx``, ``window`` as in ``Attention.forward``."""
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_mask, **cache_args)
        return x + self.mlp(self.mlp_norm(x))


class TransformerLM(nn.Module):
    """Token ids -> float32 logits: embedding, pre-norm ``Block``s, final RMSNorm, output head.

    The head is ``lm_head`` or, when tied, the embedding matrix; rows past
    ``vocab_size`` (padded embeddings) are dropped. ``logits_shift`` 1 is for
    models that keep the autoregressive habit of scoring token i from the hidden
    state at i-1 (Dream): ``logits[i] = head(h[i-1])``, position 0 keeping
    ``head(h[0])``; 0 scores token i from h[i] (LLaDA). Either way the output
    row for position i predicts token i, so callers stay format-agnostic.

    Subclasses set ``self.config`` (the sampler reads the special token ids
    there) and may override ``embed`` / ``logits`` for format options.
    """

    supports_kv_cache = True  # forward accepts cache= / window= (see KVCache)
    logits_shift = 0

    def __init__(
        self,
        *,
        vocab_size: int,
        embedding_rows: int,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        intermediate_size: int,
        rms_norm_eps: float,
        rope_theta: float,
        qkv_bias: bool,
        tie_head: bool,
        head_dim: int | None = None,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        self.vocab_size, self.head_dim, self.rope_theta = vocab_size, head_dim or hidden_size // num_heads, rope_theta
        self.embed_tokens = nn.Embedding(embedding_rows, hidden_size)
        self.layers = nn.ModuleList(
            Block(hidden_size, num_heads, num_kv_heads, intermediate_size, rms_norm_eps, qkv_bias, head_dim, qk_norm)
            for _ in range(num_layers)
        )
        self.norm = RMSNorm(hidden_size, rms_norm_eps)
        self.lm_head = None if tie_head else nn.Linear(hidden_size, embedding_rows, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, L) ids -> (B, L, hidden) input embeddings."""
        return self.embed_tokens(input_ids)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        window: Window | None = None,
        layout_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states (unshifted).

        Args:
            input_ids: (B, T) int64 token ids (always the whole canvas).
            attention_mask: optional (B, T) bool, False on padding: padding keys
                are never attended and positions count real tokens only (see
                ``positions_and_mask``).
            cache: with ``window`` None, a KVCache that this full pass (re)fills;
                with ``window`` (w0, w1) or per-row columns (B, Lw) (see ``Window``),
                a filled cache: only those positions are computed, their
                keys/values are written back into the cache and the other
                positions' keys/values are read from it.
            layout_mask: optional (B, 1, Lq, T) bool query/key mask of a block-diffusion layout
                (``celeris.models.contract.layout_mask``), combined with the padding mask.

        Returns:
            (B, T, hidden), or (B, Lw, hidden) for a window pass, in the
            parameter dtype.
        """
        positions, attn_mask = positions_and_mask(input_ids, attention_mask)
        if layout_mask is not None:
            attn_mask = layout_mask if attn_mask is None else layout_mask & attn_mask
        if cache is not None and window is None:
            cache.keys.clear()
            cache.values.clear()
        ids, positions = window_inputs(input_ids, positions, window)  # (B, Lq)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
        x = self.embed(ids)  # (B, Lq, d)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn_mask, cache=cache, layer_idx=i, window=window)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output head, no shift: (..., hidden) -> (..., vocab_size) float32 logits."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight[: self.vocab_size]).float()

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
        """(B, T) token ids -> (B, L', vocab_size) float32 logits where row i predicts token i.

        With per-row window columns (B, Lw), ``logits_index`` (B, L') picks which
        of them to score (default: all); ``logits_slice`` is not used then.

        ``logits_slice`` (canvas coordinates, contiguous) picks the output
        positions (L' of them; default: the window, else all T); with a window it
        must lie inside it. ``cache``/``window``: see ``hidden_states``. With
        ``logits_shift`` 1, when the slice starts at w0, the window pass starts one
        position earlier (at ``max(w0 - 1, 0)``) so that the hidden state scoring
        position w0 is fresh; that position's keys/values are then written back as well.
        A slice that starts after w0 has its sources inside the window, which is then
        computed as given. ``return_hidden`` returns ``hidden_states`` for the window as given.

        Raises:
            ValueError: ``logits_slice`` has a step or leaves the window.
        """
        if return_hidden:
            return self.hidden_states(input_ids, attention_mask, cache, window)
        return scored_logits(self, input_ids, attention_mask, logits_slice, cache, window, logits_index)


def scored_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits_slice: slice | None,
    cache: KVCache | None,
    window: Window | None,
    logits_index: torch.Tensor | None,
) -> torch.Tensor:
    """The logits a model's ``forward`` returns, row i predicting token i, whatever its ``logits_shift``.

    ``model`` has ``hidden_states(ids, mask, cache, window)``, ``logits(hidden)`` and
    ``logits_shift``: 0 scores token i from the hidden state at i (LLaDA, the
    bidirectional Celeris model); 1 scores it from the hidden state at i - 1
    (Dream, and any causal model: the next-token habit), position 0 keeping its
    own. Arguments as in ``TransformerLM.forward``.

    Returns:
        (B, L', vocab_size) float32 logits.

    Raises:
        ValueError: ``logits_slice`` has a step or leaves the window.
    """
    if isinstance(window, torch.Tensor):
        if logits_index is None:
            logits_index = torch.arange(window.shape[1], device=window.device).expand_as(window)
        if not model.logits_shift:
            hidden = model.hidden_states(input_ids, attention_mask, cache, window)  # (B, Lw, d)
            return model.logits(gather_positions(hidden, logits_index))
        # a shifted model scores column c from the hidden state at c - 1 (column 0 from its own)
        source = (window.gather(1, logits_index) - model.logits_shift).clamp(min=0)  # (B, L')
        found = window[:, None, :] == source[:, :, None]  # (B, L', Lw)
        if bool(found.any(-1).all()):  # every source column is in the window already (e.g. a block's first step)
            hidden = model.hidden_states(input_ids, attention_mask, cache, window)
            return model.logits(gather_positions(hidden, found.int().argmax(-1)))
        # otherwise compute them too (a column listed twice computes the same keys/values twice)
        cols = torch.cat([window, source], dim=1)
        hidden = model.hidden_states(input_ids, attention_mask, cache, cols)
        return model.logits(hidden[:, window.shape[1] :])
    w0, w1 = window if window is not None else (0, input_ids.shape[1])
    if logits_slice is None:
        start, stop = w0, w1
    else:
        start = 0 if logits_slice.start is None else logits_slice.start
        stop = input_ids.shape[1] if logits_slice.stop is None else logits_slice.stop
        if logits_slice.step not in (None, 1) or not w0 <= start <= stop <= w1:
            raise ValueError(f"logits_slice {logits_slice} must be contiguous and inside positions [{w0}, {w1})")
    h0 = max(min(w0, start - model.logits_shift), 0)  # first position whose hidden state is needed
    hidden = model.hidden_states(input_ids, attention_mask, cache, None if window is None else (h0, w1))
    a, z = start - model.logits_shift - h0, stop - model.logits_shift - h0  # rows of `hidden` for the slice
    rows = hidden[:, max(a, 0) : max(z, 0)]
    if a < 0 < z - a:  # position 0 of a shifted model is scored from its own hidden state
        rows = torch.cat([hidden[:, :1], rows], dim=1)
    return model.logits(rows)


class FormatConfig:
    """``config.json`` reading for the published formats' config dataclasses.

    Subclasses are dataclasses whose field names are the published keys;
    ``NULLABLE`` names keys whose explicit null is meaningful (kept), every
    other null means "use the default"; ``FORMAT`` names the format in errors.
    """

    NULLABLE: tuple[str, ...] = ()
    FORMAT = "model"

    @classmethod
    def from_json(cls, path: str | Path) -> Self:
        """Read ``config.json``; unknown keys are ignored.

        Special ids missing from the config (or null) come from the tokenizer
        files beside it; a missing pad id falls back to the end-of-text id.

        Raises:
            ValueError: no mask id anywhere, or an unsupported setting.
        """
        path = Path(path)
        raw = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known and (v is not None or k in cls.NULLABLE)}
        values.update(special_token_ids(raw, path.parent))
        return cls(**values)

    def validate(self, unsupported: list[tuple[bool, str]], heads: dict[str, int]) -> None:
        """Refuse what Celeris does not compute, rather than computing it wrongly.

        Args:
            unsupported: (setting is used, what it is) pairs; the first used one is refused.
            heads: the config's names -> values of the hidden size, the query heads and the K/V heads,
                in that order; each must divide by the next.

        Raises:
            ValueError: an unsupported setting, sizes that do not divide, or a special token id
                outside [0, vocab_size).
        """
        for bad, what in unsupported:
            if bad:
                raise ValueError(f"this {self.FORMAT} config uses {what}, which Celeris does not implement")
        (hidden, d), (query, h), (kv, hkv) = heads.items()
        if d % h or h % hkv:
            raise ValueError(f"{hidden} ({d}) must divide by {query} ({h}) and that by {kv} ({hkv})")
        for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")
