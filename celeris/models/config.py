"""``config.json`` reading shared by every native format's config dataclass, and the Qwen2/Qwen3 keys.

One reader (``FormatConfig.from_json``) and one check (``FormatConfig.validate``: refused settings, head counts
that divide, special token ids inside the vocabulary) serve Celeris, LLaDA, Dream, SDAR, Fast-dLLM v2 and
LLaDA2.0. ``QwenConfig`` holds the keys the Qwen2 / Qwen3 configs (Dream, Fast-dLLM v2, SDAR, and LLaDA2.0's
Ling config) share, with their common refusals; each format's class declares only its own keys and defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Self

from celeris.models.contract import DecodingContract, contract_special_ids
from celeris.models.layers import Architecture
from celeris.models.rope import read_rope
from celeris.tokenizer import special_token_ids


class FormatConfig:
    """``config.json`` reading for the formats' config dataclasses.

    Subclasses are dataclasses whose field names are the published keys; ``NULLABLE`` names keys whose
    explicit null is meaningful (kept), every other null means "use the default"; ``FORMAT`` names the
    format in errors. ``architecture()`` gives the ``TransformerLM`` shape the config describes.
    """

    NULLABLE: tuple[str, ...] = ()
    FORMAT = "model"
    SPECIAL_IDS = ("mask_token_id", "eos_token_id", "pad_token_id")  # ids that must lie inside the vocabulary

    @classmethod
    def complete(cls, raw: dict, folder: Path) -> dict:
        """Hook: fill in keys a folder may leave out (block formats: the contract's mask token); ``raw`` as is."""
        return raw

    @classmethod
    def from_json(cls, path: str | Path) -> Self:
        """Read ``config.json``; unknown keys (e.g. ``architectures``) are ignored.

        Special ids missing from the config (or null) come from the tokenizer
        files beside it; a missing pad id falls back to the end-of-text id.

        Raises:
            ValueError: no mask id anywhere, or an unsupported setting.
        """
        path = Path(path)
        raw = cls.complete(json.loads(path.read_text()), path.parent)
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known and (v is not None or k in cls.NULLABLE)}
        values.update(special_token_ids(raw, path.parent))
        return cls(**values)

    def validate(self, unsupported: list[tuple[bool, str]], sizes: dict[str, int]) -> None:
        """Refuse what Celeris does not compute, rather than computing it wrongly.

        Args:
            unsupported: (setting is used, what it is) pairs; the first used one is refused.
            sizes: the config's names -> values of the attention width, the query heads and (optionally) the
                K/V heads, in that order; each must divide by the next.

        Raises:
            ValueError: an unsupported setting, sizes that do not divide, or a special token id
                outside [0, vocab_size).
        """
        for bad, what in unsupported:
            if bad:
                raise ValueError(f"this {self.FORMAT} config uses {what}, which Celeris does not implement")
        named = list(sizes.items())
        for (_, a), (_, b) in zip(named, named[1:], strict=False):
            if b < 1 or a % b:
                raise ValueError(" must divide by ".join(f"{n} ({v})" for n, v in named))
        for name in self.SPECIAL_IDS:
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")

    def architecture(self) -> Architecture:
        """The ``TransformerLM`` shape this config describes."""
        raise NotImplementedError


class BlockFormatConfig(FormatConfig):
    """``FormatConfig`` for a block-diffusion format: the mask id may come from its ``CONTRACT`` table entry
    (``contract_special_ids``) when the folder does not state it; ``block_contract`` is that entry with the
    block size the config states (``BLOCK_SIZE_KEY``, if any)."""

    CONTRACT: DecodingContract
    BLOCK_SIZE_KEY: str | None = None

    @classmethod
    def complete(cls, raw: dict, folder: Path) -> dict:
        """The contract's mask token as the last source of the mask id."""
        return contract_special_ids(raw, folder, cls.CONTRACT)

    @property
    def block_size_stated(self) -> int | None:
        """The block size the config states (its ``BLOCK_SIZE_KEY``), or None."""
        return getattr(self, self.BLOCK_SIZE_KEY) if self.BLOCK_SIZE_KEY else None

    @property
    def block_contract(self) -> DecodingContract:
        return self.CONTRACT.with_block_size(self.block_size_stated)

    def unsupported(self) -> list[tuple[bool, str]]:
        """A stated block size below 1, then the format's own refusals (``format_unsupported``)."""
        size = self.block_size_stated
        return [(size is not None and size < 1, f"{self.BLOCK_SIZE_KEY} {size}"), *self.format_unsupported()]

    def format_unsupported(self) -> list[tuple[bool, str]]:
        """The format's own (setting is used, what it is) refusals."""
        return []


@dataclass
class QwenConfig(FormatConfig):
    """The keys shared by the Qwen2 / Qwen3 configs (field names of transformers' ``Qwen2Config``).

    ``num_key_value_heads`` None means ``num_attention_heads``; ``head_dim`` None means hidden_size //
    num_attention_heads. RoPE is read from ``rope_scaling`` or transformers 5's ``rope_parameters`` (which also
    holds ``rope_theta``) into ``rope_theta`` and ``rope`` (``celeris.models.rope.read_rope``); a scaled RoPE is
    used where the class sets ``SCALED_ROPE`` (the causal formats), else only plain RoPE. SiLU and no sliding
    window only; anything else is refused in ``__post_init__`` (with a subclass's ``unsupported()``) rather than
    computed wrongly. Subclasses redeclare the defaults of their published model.
    """

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    use_sliding_window: bool = False
    mask_token_id: int = -1
    eos_token_id: int = -1
    pad_token_id: int = -1

    NULLABLE = ("rope_scaling", "rope_parameters")  # an explicit null means plain RoPE
    SCALED_ROPE = False  # whether this format computes rope types other than "default"

    def __post_init__(self) -> None:
        raw = {"rope_scaling": self.rope_scaling, "rope_parameters": self.rope_parameters}
        self.rope_theta, self.rope = read_rope(raw | {"rope_theta": self.rope_theta}, self.max_position_embeddings,
                                               self.rope_theta)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        width = "hidden_size" if self.head_dim is None else "num_attention_heads * head_dim"
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        unsupported = [
            (self.hidden_act != "silu", f"hidden_act '{self.hidden_act}' (only 'silu')"),
            (self.rope is not None and not self.SCALED_ROPE,
             f"rope_scaling {self.rope_scaling or self.rope_parameters} (only plain RoPE)"),
            (self.use_sliding_window, "use_sliding_window"),
            *self.unsupported(),
        ]
        self.validate(unsupported, {width: self.num_attention_heads * self.head_dim,
                                    "num_attention_heads": self.num_attention_heads,
                                    "num_key_value_heads": self.num_key_value_heads})

    def unsupported(self) -> list[tuple[bool, str]]:
        """The format's own (setting is used, what it is) refusals."""
        return []

    def architecture(self, **options: object) -> Architecture:
        """The Qwen2 / Qwen3 architecture; ``options``: the format's own ``Architecture`` fields (biases, q/k norm,
        shift)."""
        return Architecture(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_hidden_layers,
                            num_heads=self.num_attention_heads, num_kv_heads=self.num_key_value_heads,
                            head_dim=self.head_dim, intermediate_size=self.intermediate_size,
                            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_scaling=self.rope,
                            tie_head=self.tie_word_embeddings, **options)


# Qwen2's tensor names (Dream, Fast-dLLM v2) -> module names ("{i}": the layer index; "[part]": a row block
# of a fused projection, packed at load time by celeris.models.loader).
QWEN_ATTENTION = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attn.qkv_proj.weight[q]",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attn.qkv_proj.weight[k]",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attn.qkv_proj.weight[v]",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attn.o_proj.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.gate_up_proj.weight[gate]",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.gate_up_proj.weight[up]",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.down_proj.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
QWEN2_KEYS = QWEN_ATTENTION | {  # Qwen2: biases on q/k/v
    "model.layers.{i}.self_attn.q_proj.bias": "layers.{i}.attn.qkv_proj.bias[q]",
    "model.layers.{i}.self_attn.k_proj.bias": "layers.{i}.attn.qkv_proj.bias[k]",
    "model.layers.{i}.self_attn.v_proj.bias": "layers.{i}.attn.qkv_proj.bias[v]",
}
QWEN3_KEYS = QWEN_ATTENTION | {  # Qwen3: no q/k/v biases, per-head q/k RMSNorm
    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.attn.q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.attn.k_norm.weight",
}
