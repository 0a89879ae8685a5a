"""The one transformer of every native model format, and its building blocks.

Celeris, LLaDA, Dream, SDAR, Fast-dLLM v2 and LLaDA2.0 are all Llama-style transformers (arXiv:2302.13971):
pre-norm blocks of RMSNorm -> attention with rotary position embeddings -> residual, RMSNorm -> SwiGLU MLP
(or a mixture of experts) -> residual, used bidirectionally for masked diffusion (LLaDA arXiv:2502.09992,
Dream arXiv:2508.15487), block-causally for block diffusion (SDAR arXiv:2510.06303) or causally (the
autoregressive Celeris twin). What differs between formats is data: an ``Architecture`` (head counts, biases,
q/k norm, partial RoPE, tied head, causal, logit shift) read from the format's config, and a CHECKPOINT_KEYS
table from the published tensor names to the module names here. This module holds:

- ``RMSNorm``, ``KVCache`` and the window helpers of the cache interface (RoPE: ``celeris.models.rope``);
- ``Attention`` (fused ``qkv_proj``), ``MLP`` (fused ``gate_up_proj``) and ``Block``; separate published
  q/k/v and gate/up tensors are packed into the fused projections at load time (``parts``,
  ``celeris.models.loader``);
- ``TransformerLM``: embedding -> blocks -> final norm -> output head, with the KV-cache interface
  (``cache=`` / ``window=``) and ``scored_logits`` (the logit shift).

Module names (``embed_tokens``, ``layers.N.attn.qkv_proj``, ``layers.N.mlp.gate_up_proj``, ``norm``,
``lm_head`` ...) are what each format's ``CHECKPOINT_KEYS`` table renames the published tensor names to, and
the Celeris checkpoint format on disk; changing one here means changing those tables.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from celeris.models import fast_ops
from celeris.models.rope import RopeScaling, apply_rope, rope_cos_sin


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (arXiv:1910.07467); computed in float32.

    ``x / sqrt(mean(x^2, -1) + eps) * weight`` for x (..., dim); returns x's dtype.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fast = False  # celeris.models.fast_ops.enable: the CPU fast pass's kernel where it applies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast and (out := fast_ops.rms_norm(x, self.weight, self.eps)) is not None:
            return out
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)  # one fused op


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


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor whose memory becomes resident only where it is written, for a KV store sized for the longest
    request: on the CPU, an anonymous private mapping (fresh pages the OS maps, all zero, on first touch) with
    transparent huge pages refused, so a row of 8,192 positions that holds 200 costs the 4 KiB pages of 200;
    elsewhere ``torch.zeros``.

    Not NumPy's ``zeros``: it asks the kernel for huge pages on a large block (``madvise(MADV_HUGEPAGE)``), and
    then the first write into each 2 MiB of a row zeroes 2 MiB (measured: storing the prefill of 8 requests, 200
    columns each, into a SmolLM2 store of 8 rows took 3.9 s and grew the process by gigabytes)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows: no private anonymous mapping by flags; NumPy's calloc instead
        return torch.zeros(shape, dtype=dtype)
    count = 1
    for n in shape:
        count *= n
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    raw = np.frombuffer(pages, dtype=np.uint8, count=nbytes)  # the array keeps the mapping alive, the tensor both
    return torch.from_numpy(raw).view(dtype).reshape(shape)


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


@dataclass(frozen=True)
class Architecture:
    """The shape of one ``TransformerLM``, read off a format's config (its ``architecture()`` method).

    Attributes:
        vocab_size: logits width; ``embedding_rows`` (default: vocab_size) may be larger (padded embeddings,
            whose extra rows are dropped from the logits).
        num_heads / num_kv_heads / head_dim: query heads, K/V heads (grouped-query attention) and the width of
            one head; ``rotary_dim`` (default: head_dim) is how many of a head's dimensions RoPE rotates
            (LLaDA2.0's ``partial_rotary_factor``).
        rope_scaling: a context-extension scaling of RoPE (``celeris.models.rope``: linear, llama3, yarn), or None.
        qkv_bias / o_bias / mlp_bias: biases on the q/k/v rows, on the output projection, on the MLP's projections.
        qk_norm: Qwen3's per-head RMSNorm of queries and keys before RoPE (SDAR, LLaDA2.0).
        tie_head: the output head is the embedding matrix (no ``lm_head``).
        is_causal: causal attention (the autoregressive Celeris twin); otherwise bidirectional unless a
            caller passes a layout mask.
        logits_shift: 1 when the hidden state at i - 1 scores token i (Dream, Fast-dLLM v2, causal models).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    embedding_rows: int | None = None
    rotary_dim: int | None = None
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_head: bool = False
    is_causal: bool = False
    logits_shift: int = 0


class Attention(nn.Module):
    """Attention with RoPE, one fused q/k/v projection and grouped K/V heads.

    Llama's attention (arXiv:2302.13971) with grouped-query K/V heads (GQA, arXiv:2305.13245: query head h
    reads K/V head ``h // (num_heads // num_kv_heads)``). ``qkv_proj`` holds the query, key and value rows
    stacked in that order ((H + 2 H_kv) x D rows), so one matmul computes all three; published checkpoints
    with separate q/k/v tensors are packed into it at load time (``parts``; ``celeris.models.loader``), as
    nano-vllm's packed modules and gpt-fast's load hook do. Options (``Architecture``): biases on q/k/v (Qwen2,
    Dream; LLaDA's ``include_qkv_bias``) and on the output (LLaDA2.0's ``use_bias``), Qwen3's per-head
    RMSNorm of queries and keys before RoPE (``q_norm`` / ``k_norm``), RoPE on the first ``rotary_dim``
    dimensions of each head only, and causal attention.
    Shapes: x (B, L, hidden) -> (B, L, hidden); q (B, H, L, D), k/v (B, H_kv, L, D).
    """

    def __init__(self, arch: Architecture) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.rotary_dim, self.is_causal = arch.rotary_dim or arch.head_dim, arch.is_causal
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, rows, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, arch.hidden_size, bias=arch.o_bias)
        self.fast = False  # celeris.models.fast_ops.enable: the CPU fast pass's attention for a few queries

    def parts(self) -> dict[str, dict[str, int]]:
        """Packed projection -> {part: rows}, in the order the parts are stacked (the loader's packing step)."""
        kv = self.num_kv_heads * self.head_dim
        return {"qkv_proj": {"q": self.num_heads * self.head_dim, "k": kv, "v": kv}}

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first ``rotary_dim`` dimensions of each head of x (B, H, L, D); the rest pass through."""
        if self.rotary_dim == self.head_dim:
            return apply_rope(x, cos, sin)
        r = self.rotary_dim
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

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
        """x (B, L, hidden), cos/sin (B, 1, L, rotary_dim), attn_mask broadcastable to (B, H, L, T) bool or None.

        ``cache``, ``layer_idx``, ``window``: see ``update_cache``; with a window the queries attend to all T
        cached positions. Without a mask or window a causal layout uses SDPA's ``is_causal`` fast path.
        """
        b, length, _ = x.shape
        qkv = self.qkv_proj(x)
        if self.fast and cache is not None and window is not None and self.q_norm is None \
                and self.rotary_dim == self.head_dim and (out := fast_ops.rope_cache_attention(
                    qkv, cos, sin, cache.keys[layer_idx], cache.values[layer_idx], window, attn_mask,
                    self.num_heads, self.num_kv_heads)) is not None:
            return self.o_proj(out)  # RoPE, the cache write and attention in one kernel call
        qkv = qkv.view(b, length, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)  # (B, L, H or Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, L, D), (B, Hkv, L, D)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        k, v = update_cache(k, v, cache, layer_idx, window)  # (B, Hkv, T, D) with a window
        is_causal = self.is_causal and attn_mask is None and window is None
        if self.fast and (out := fast_ops.attention(q, k, v, attn_mask, is_causal)) is not None:
            return self.o_proj(out)  # (B, L, H * D)
        # grouped-query attention: each K/V head serves a group of consecutive query heads (SDPA's enable_gqa,
        # without materialising the repeated K/V)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=self.num_kv_heads != self.num_heads,
        )  # (B, H, L, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward (arXiv:2002.05202): ``down(silu(gate(x)) * up(x))``, (..., hidden) -> (..., hidden).

    ``gate_up_proj`` stacks the gate rows over the up rows (one matmul); separate published gate/up tensors
    are packed into it at load time (``parts``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.fast = False  # celeris.models.fast_ops.enable: the CPU fast pass's silu(gate) * up

    def parts(self) -> dict[str, dict[str, int]]:
        """Packed projection -> {part: rows}, in stacking order."""
        return {"gate_up_proj": {"gate": self.down_proj.in_features, "up": self.down_proj.in_features}}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fast and (hidden := fast_ops.silu_mul(gate_up)) is not None:
            return self.down_proj(hidden)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block (Llama): ``x += attn(attn_norm(x)); x += mlp(mlp_norm(x))``, (B, L, hidden)."""

    def __init__(self, arch: Architecture, make_mlp: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.attn = Attention(arch)  # built before the MLP: random initialisation draws in this order
        self.mlp_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = make_mlp()
        self.fused = False  # celeris.models.fast_ops.enable: the whole layer in one kernel call where it fits

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None, **cache_args
    ) -> torch.Tensor:
        """``cache_args``: ``cache``, ``layer_idx``, ``window`` as in ``Attention.forward``."""
        if self.fused and (out := fast_ops.decoder_layer(self, x, cos, sin, attn_mask, **cache_args)) is not None:
            return out
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_mask, **cache_args)
        return x + self.mlp(self.mlp_norm(x))


class TransformerLM(nn.Module):
    """Token ids -> float32 logits: embedding, pre-norm ``Block``s, final RMSNorm, output head.

    The one transformer of every native format (Celeris, LLaDA, Dream, SDAR, Fast-dLLM v2, LLaDA2.0); a
    format's config gives its ``Architecture`` and its CHECKPOINT_KEYS table maps the published tensor names onto
    these modules. The head is ``lm_head`` or, when tied, the embedding matrix; rows past ``vocab_size``
    (padded embeddings) are dropped. ``logits_shift`` 1 is for models that keep the autoregressive habit of
    scoring token i from the hidden state at i-1 (Dream, causal models): ``logits[i] = head(h[i-1])``,
    position 0 keeping ``head(h[0])``; 0 scores token i from h[i] (LLaDA). Either way the output row for
    position i predicts token i, so callers stay format-agnostic.

    ``config`` (the sampler reads the special token ids there) has ``architecture() -> Architecture`` and may have
    ``block_contract`` (``celeris.models.contract``: how to decode a block-diffusion model). Subclasses may
    override ``make_mlp`` (mixture-of-experts layers), ``embed`` and ``logits`` for format options.
    """

    supports_kv_cache = True  # forward accepts cache= / window= (see KVCache)

    def __init__(self, config: object) -> None:
        super().__init__()
        self.config = config
        arch = self.arch = config.architecture()
        self.vocab_size, self.logits_shift, self.is_causal = arch.vocab_size, arch.logits_shift, arch.is_causal
        self.block_contract = getattr(config, "block_contract", None)
        rows = arch.embedding_rows or arch.vocab_size
        # on the meta device (a load that assigns every weight) no initialisation: Embedding's normal_ on meta
        # imports PyTorch's Python meta kernels (about 800 modules, 74 MB resident) for values never read
        meta = torch.empty(()).device.type == "meta"
        self.embed_tokens = nn.Embedding(rows, arch.hidden_size, _weight=torch.empty(rows, arch.hidden_size)) \
            if meta else nn.Embedding(rows, arch.hidden_size)
        self.layers = nn.ModuleList(Block(arch, partial(self.make_mlp, i)) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_head else nn.Linear(arch.hidden_size, rows, bias=False)
        self.layer_stack = None  # celeris.models.fast_ops.enable: every layer in one kernel call where all fit

    def make_mlp(self, index: int) -> nn.Module:
        """The feed-forward module of layer ``index``: a SwiGLU ``MLP`` (mixture-of-experts formats override)."""
        return MLP(self.arch.hidden_size, self.arch.intermediate_size, self.arch.mlp_bias)

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
                ``positions_and_mask``), so a left-padded row computes exactly what
                the unpadded row computes.
            cache: with ``window`` None, a KVCache that this full pass (re)fills;
                with ``window`` (w0, w1) or per-row columns (B, Lw) (see ``Window``),
                a filled cache: only those positions are computed, their
                keys/values are written back into the cache and the other
                positions' keys/values are read from it.
            layout_mask: optional (B, 1, Lq, T) bool query/key mask of a block-diffusion layout
                (``celeris.models.contract.layout_mask``), used instead of the causal rule and combined
                with the padding mask.

        Returns:
            (B, T, hidden), or (B, Lw, hidden) for a window pass, in the
            parameter dtype.
        """
        positions, attn_mask = positions_and_mask(input_ids, attention_mask)  # None mask: SDPA's fast path
        if layout_mask is not None:
            attn_mask = layout_mask if attn_mask is None else layout_mask & attn_mask
        elif self.is_causal and (attn_mask is not None or window is not None):
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
        capture: dict[int, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """The transformer on a layout the caller builds: (B, Lq) ids at (B, Lq) RoPE positions with an SDPA
        mask (B or 1, 1, Lq, T) bool (True: attend), or None for the layout's own rule -> (B, Lq, d) final
        normed hidden states. ``cache``/``window`` as in ``hidden_states`` (``window`` (B, Lq) per-row columns
        or a span). The hybrid objective's two-stream layout and verified decoding's passes use it.
        ``capture``: layer index -> filled in place with that decoder layer's output (B, Lq, d), before the
        final norm (transformers' ``hidden_states[index + 1]``; a DFlash drafter's context features).
        """
        cos, sin = rope_cos_sin(positions, self.arch.rotary_dim or self.arch.head_dim, self.arch.rope_theta,
                                self.arch.rope_scaling)
        x = self.embed(ids)  # (B, Lq, d)
        if self.layer_stack is not None and \
                (out := self.layer_stack(x, cos, sin, attn_mask, cache, window, capture, self.norm)) is not None:
            return out  # the final norm applied in the stack's call
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn_mask, cache=cache, layer_idx=i, window=window)
            if capture is not None and i in capture:
                capture[i] = x
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
        computed as given. ``return_hidden`` returns ``hidden_states`` for the window as given
        (training computes the head only at masked positions).

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


