"""DFlash: a block-diffusion drafter that reads a frozen autoregressive target's hidden states.

DFlash (arXiv:2602.06036; published code github:z-lab/dflash ``dflash/model.py``, class ``DFlashDraftModel``) drafts a
whole block in one non-causal forward pass: the block is the last accepted token followed by ``block_size - 1`` mask
tokens, embedded with the **target's** embedding table; every drafter layer attends, from the block's queries, to
keys/values of (a) the context features ``hidden_norm(fc(concat of the target's hidden states at
target_layer_ids))`` for every position before the block and (b) the block itself, through the layer's own
``k_proj`` / ``v_proj`` / ``k_norm`` (the context has no queries and no MLP of its own). The final RMSNorm's output
is scored by the **target's** LM head; row i of the block (i >= 1) drafts the token at block position i.

Layers are Qwen3's (per-head q/k RMSNorm before RoPE, SwiGLU MLP, pre-norm residuals); tensor names are the published
ones (``layers.N.self_attn.q_proj.weight``, ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``, ...), so a folder
z-lab publishes loads as is. ``target_layer_ids`` index decoder-layer outputs: ``hidden_states[id + 1]`` in
transformers' list of hidden states, the output of ``layers[id]`` here.

Celeris extension: a pruned draft vocabulary (EAGLE-3's and FR-Spec's ``d2t`` idea, arXiv:2502.14856): the target's
head restricted to its ``draft_vocab`` most frequent ids (``draft_vocab.safetensors``: ``d2t`` int64), which cuts
the head's cost per drafted position; drafts are mapped back to target ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from celeris.models import fast_ops
from celeris.models.layers import RMSNorm, apply_rope, rope_cos_sin, zeros_on_demand


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default target layers: the middle one for a 1-layer drafter, else spread over [1, L - 3].

    ``build_target_layer_ids(30, 1) == [15]``, ``(30, 2) == [1, 27]`` (z-lab/dflash ``build_target_layer_ids``).
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    """The keys of a DFlash drafter's ``config.json`` (Qwen3's layer fields plus the DFlash ones).

    ``target_layer_ids`` and ``mask_token_id`` live under ``dflash_config`` in the published file; ``draft_vocab``
    (0: the full target vocabulary) is the Celeris extension.

    Raises:
        ValueError: sizes that do not divide, a block size below 2, a target layer outside the target.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 32768
    mask_token_id: int | None = None
    target_layer_ids: list[int] = field(default_factory=list)
    draft_vocab: int = 0

    def __post_init__(self) -> None:
        if not self.target_layer_ids:
            self.target_layer_ids = build_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must divide by "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.block_size < 2:
            raise ValueError(f"block_size {self.block_size} must be at least 2 (one accepted token and one draft)")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} are outside the target's {self.num_target_layers} layers")

    @classmethod
    def from_dict(cls, raw: dict) -> DFlashConfig:
        """From a published ``config.json`` dict (``dflash_config`` nested, ``rope_parameters`` or ``rope_theta``)."""
        dflash = raw.get("dflash_config") or {}
        rope = (raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", 1000000.0))
        head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        return cls(hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
                   num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
                   num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
                   head_dim=head_dim, vocab_size=raw["vocab_size"], num_target_layers=raw["num_target_layers"],
                   block_size=raw.get("block_size", 16), rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                   rope_theta=float(rope), max_position_embeddings=raw.get("max_position_embeddings", 32768),
                   mask_token_id=dflash.get("mask_token_id"), target_layer_ids=list(dflash.get("target_layer_ids") or []),
                   draft_vocab=int(raw.get("draft_vocab", 0) or 0))

    def to_dict(self) -> dict:
        """The published ``config.json`` layout (what ``from_dict`` reads)."""
        return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim, "vocab_size": self.vocab_size, "num_target_layers": self.num_target_layers,
                "block_size": self.block_size, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
                "max_position_embeddings": self.max_position_embeddings, "attention_bias": False,
                "hidden_act": "silu", "tie_word_embeddings": False, "draft_vocab": self.draft_vocab,
                "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids}}


@dataclass
class DraftKVCache:
    """The drafter's keys/values per layer for the context positions already seen: grown tensors, (B, H_kv, T, D)
    each (T the positions held), or, once ``bind``-ed, buffers (B, H_kv, C, D) of which the first ``filled`` columns
    are held (the engine's KV store's rows: ``celeris.engine.kv.KVStore``); both give the same keys/values.

    DFlash keeps the context features' keys/values of accepted positions; the block's own entries are dropped right
    after drafting (``crop``), and newly accepted positions' features enter at the next drafter call.
    """

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    filled: int | None = None  # bound to buffers: the columns held; None: keys/values are exactly the ones held

    @property
    def length(self) -> int:
        if self.filled is not None:
            return self.filled
        return self.keys[0].shape[2] if self.keys else 0

    def bind(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Hold the keys/values in buffers from now on: per layer (B, H_kv, C, D), whose first ``length`` columns
        already hold this cache's positions (a fresh cache: none). The next call writes its columns into them.

        Raises:
            ValueError: grown tensors are held (their positions are not in the buffers).
        """
        if self.filled is None and self.keys:
            raise ValueError("a drafter cache that grew its own tensors cannot move into buffers")
        self.filled = self.length
        self.keys, self.values = keys, values

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one call's keys/values (B, H_kv, n, D) of layer ``layer_idx`` after the held positions; returns the
        layer's keys and values of every position, (B, H_kv, length + n, D). Bound, it writes into the buffers
        (``advance`` then counts the n columns, once every layer has written them).

        Raises:
            ValueError: the buffers have fewer than length + n columns.
        """
        if self.filled is None:
            if len(self.keys) <= layer_idx:
                self.keys.append(k)
                self.values.append(v)
            else:
                self.keys[layer_idx] = torch.cat([self.keys[layer_idx], k], dim=2)
                self.values[layer_idx] = torch.cat([self.values[layer_idx], v], dim=2)
            return self.keys[layer_idx], self.values[layer_idx]
        end = self.filled + k.shape[2]
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if end > keys.shape[2]:
            raise ValueError(f"the drafter's cache holds {keys.shape[2]} columns, a call needs {end}")
        keys[:, :, self.filled : end] = k
        values[:, :, self.filled : end] = v
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, n: int) -> None:
        """Count the ``n`` columns every layer has just written (``update``) as held (grown tensors count
        themselves)."""
        if self.filled is not None:
            self.filled += n

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions of every layer."""
        if self.filled is not None:
            self.filled = min(self.filled, length)
            return
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from the context features and the block; non-causal.

    Shapes: x (B, Lq, d) block, ctx (B, Lc, d) projected context features -> (B, Lq, d).
    """

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.fast = False  # celeris.models.fast_ops.enable: the CPU fast pass's attention

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None, cache: DraftKVCache | None, layer_idx: int) -> torch.Tensor:
        """``cos``/``sin`` (B, 1, Lc + Lq, D) for the context positions then the block's; ``attn_mask`` broadcastable
        to (B, H, Lq, T) bool (True: attend) or None (every key); ``cache``: earlier context keys/values, extended
        in place with this call's context and block."""
        b, lq, _ = x.shape
        lc = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, lq, self.num_heads, self.head_dim)).transpose(1, 2)  # (B, H, Lq, D)
        both = torch.cat([ctx, x], dim=1)  # (B, Lc + Lq, d)
        k = self.k_norm(self.k_proj(both).view(b, lc + lq, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(both).view(b, lc + lq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos[:, :, lc:], sin[:, :, lc:]), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v)
        if self.fast and (out := fast_ops.attention(q, k, v, attn_mask, is_causal=False)) is not None:
            return self.o_proj(out)  # (B, Lq, H * D)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,  # (B, H, Lq, D); K/V heads shared by
                                             enable_gqa=self.num_kv_heads != self.num_heads)  # groups of queries
        return self.o_proj(out.transpose(1, 2).reshape(b, lq, -1))


class DFlashMLP(nn.Module):
    """SwiGLU, Qwen3's ``mlp.gate_proj`` / ``up_proj`` / ``down_proj``: (..., d) -> (..., d)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

        self.fast = False  # celeris.models.fast_ops.enable: the CPU fast pass's silu(gate) * up (after ``fuse``)

    def fuse(self) -> None:
        """Stack ``gate_proj`` and ``up_proj`` into one ``gate_up_proj`` (2 I, d) (one product a call instead of
        two; the same rows, so a row-wise quantized product gives the same numbers); for inference only (the
        state dict's names change)."""
        fused = nn.Linear(self.gate_proj.in_features, 2 * self.gate_proj.out_features, bias=False, device="meta")
        with torch.no_grad():  # its weight is the stacked rows (built on meta: no random init to overwrite)
            fused.weight = nn.Parameter(torch.cat([self.gate_proj.weight, self.up_proj.weight]))
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "gate_up_proj"):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = self.gate_up_proj(x)
        if self.fast and (hidden := fast_ops.silu_mul(gate_up)) is not None:
            return self.down_proj(hidden)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DFlashLayer(nn.Module):
    """Pre-norm block over the block's hidden states: ``x += attn(norm(x), ctx); x += mlp(norm(x))``."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DFlashMLP(cfg)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None, cache: DraftKVCache | None, layer_idx: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, attn_mask, cache, layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """The drafter: (block embeddings, target features) -> normed hidden states the target's head scores.

    ``forward(noise_embedding (B, Lq, d), target_hidden (B, Lc, n * d), positions (B, Lc + Lq) int64, cache,
    attn_mask) -> (B, Lq, d)``, where n = len(target_layer_ids), ``target_hidden`` holds the raw target hidden states
    of the Lc context positions not yet in ``cache`` (concatenated over the target layers), ``positions`` their
    RoPE positions followed by the block's. Training passes several blocks per row at once with a mask
    (``celeris.train.dflash``); decoding passes one block per row against the cache (``draft``).
    """

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab or cfg.vocab_size), persistent=False)
        self.draft_stack = None  # celeris.models.fast_ops.enable: every layer in one kernel call where all fit

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor,
                cache: DraftKVCache | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        dtype = self.hidden_norm.weight.dtype  # the compute dtype (the fc weight may be quantized)
        ctx = self.hidden_norm(self.fc(target_hidden.to(dtype)))  # (B, Lc, d)
        x = noise_embedding.to(dtype)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)  # (B, 1, Lc + Lq, D)
        if self.draft_stack is not None and (out := self.draft_stack(x, ctx, cos, sin, attn_mask, cache)) is not None:
            x = out  # every layer in one kernel call (``celeris.models.fast_ops.DraftStack``)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, ctx, cos, sin, attn_mask, cache, i)
        if cache is not None:
            cache.advance(ctx.shape[1] + x.shape[1])
        return self.norm(x)

    def cache_buffers(self, num_rows: int, num_cols: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zeroed keys and values for ``num_rows`` rows of ``num_cols`` positions: per layer (num_rows, H_kv,
        num_cols, head_dim), in the dtype the layers compute in, on its device (what a bound ``DraftKVCache``
        writes into: the engine's KV store holds them beside the target's layers)."""
        cfg, w = self.config, self.hidden_norm.weight
        shape = (num_rows, cfg.num_key_value_heads, num_cols, cfg.head_dim)
        return ([zeros_on_demand(shape, w.dtype, w.device) for _ in self.layers],
                [zeros_on_demand(shape, w.dtype, w.device) for _ in self.layers])

    def draft_logits(self, hidden: torch.Tensor, head_weight: torch.Tensor | nn.Module) -> torch.Tensor:
        """Scores over the draft vocabulary: hidden (B, L, d) -> (B, L, V_draft) float32 (row j: target id d2t[j]).
        ``head_weight``: the target's head rows (V or V_draft, d), or a module scoring the V_draft rows (a quantized
        head: ``celeris.sampling.drafter.DFlashProposer.draft_head``)."""
        if isinstance(head_weight, nn.Module):
            return head_weight(hidden).float()
        weight = head_weight if self.d2t.numel() == head_weight.shape[0] else head_weight[self.d2t]
        return (hidden @ weight.to(hidden.dtype).T).float()

    @torch.no_grad()
    def draft(self, last_ids: torch.Tensor, target_hidden: torch.Tensor, start: int, cache: DraftKVCache,
              embed_weight: torch.Tensor, head_weight: torch.Tensor, num_drafts: int | None = None) -> torch.Tensor:
        """Greedy drafts after ``last_ids`` (B,) at position ``start``: (B, num_drafts) int64 target ids.

        ``target_hidden`` (B, start - cache.length, n * d): the target features of the context positions the cache
        does not hold yet. The cache keeps the context after the call (the block's entries cropped), as DFlash's
        ``past_key_values_draft.crop(start)``. Drafts are argmax at every temperature (a one-hot draft distribution).
        """
        bs = self.config.block_size
        k = bs - 1 if num_drafts is None else num_drafts
        b = last_ids.shape[0]
        mask_id = self.config.mask_token_id
        block = torch.full((b, bs), mask_id, dtype=torch.long, device=last_ids.device)
        block[:, 0] = last_ids
        positions = torch.arange(cache.length, start + bs, device=last_ids.device).expand(b, -1)
        hidden = self(F.embedding(block, embed_weight), target_hidden, positions, cache)  # (B, bs, d)
        cache.crop(start)
        logits = self.draft_logits(hidden[:, 1:1 + k], head_weight)  # (B, k, V_draft)
        return self.d2t[logits.argmax(-1)]


def load_dflash(folder: str | Path, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> DFlashDraftModel:
    """A DFlash drafter folder (``config.json`` + ``model.safetensors`` with the published tensor names).

    Raises:
        ValueError: a missing file, a config that does not parse, missing or unexpected tensors, wrong shapes.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise ValueError(f"drafter folder '{folder}' has no {name}")
    try:
        cfg = DFlashConfig.from_dict(json.loads((folder / "config.json").read_text()))
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{folder / 'config.json'} is not a DFlash config: {exc}") from exc
    model = DFlashDraftModel(cfg)
    state = {k.removeprefix("model."): v for k, v in load_file(folder / "model.safetensors").items()}
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"drafter '{folder}': missing tensors {missing[:4]}, unexpected {unexpected[:4]}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"drafter tensor '{name}' has shape {tuple(tensor.shape)}, "
                             f"the config needs {tuple(expected[name].shape)}")
    model.load_state_dict(state)
    if cfg.draft_vocab:
        d2t = load_file(folder / "draft_vocab.safetensors")["d2t"]
        if d2t.shape != (cfg.draft_vocab,):
            raise ValueError(f"draft_vocab.safetensors d2t has shape {tuple(d2t.shape)}, expected ({cfg.draft_vocab},)")
        model.d2t = d2t.long()
    return model.to(device=device, dtype=dtype).eval()


def save_dflash(model: DFlashDraftModel, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``config.json``, ``model.safetensors`` (``dtype``) and, with a pruned vocabulary, the ``d2t`` map
    (``draft_vocab.safetensors``)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    save_file({k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    if model.config.draft_vocab:
        save_file({"d2t": model.d2t.cpu().contiguous()}, folder / "draft_vocab.safetensors")
