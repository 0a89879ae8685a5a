"""SDAR: the published SDAR checkpoint format (JetLM/SDAR-1.7B-Chat, -4B-Chat, -8B-Chat).

SDAR (arXiv:2510.06303) is Qwen3 converted to block diffusion: the Qwen3 module layout (``model.layers.N.*``)
with Qwen3's per-head RMSNorm of queries and keys before RoPE (``self_attn.q_norm`` / ``k_norm``), no q/k/v
biases, an explicit ``head_dim`` and grouped K/V heads; each layer: RMSNorm (``input_layernorm``) -> attention
-> residual, RMSNorm (``post_attention_layernorm``) -> SwiGLU MLP -> residual; final RMSNorm and ``lm_head``
(tied when ``tie_word_embeddings``). Attention is block-causal (query block b sees key blocks <= b); logits
are not shifted (the hidden state at i scores token i). The decoding contract (block 4, mask ``<|MASK|>``
151669, absolute block alignment, ``low_confidence_dynamic`` at threshold 0.9) is
``celeris.models.contract.CONTRACTS["sdar"]``; a config that states ``block_size`` / ``mask_token_id``
overrides it. Config keys and tensor names: ``FORMATS.md``. The MoE variant (``SDARMoeForCausalLM``) is not
implemented.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from celeris.models.contract import CONTRACTS, DecodingContract, contract_special_ids
from celeris.models.layers import FormatConfig, TransformerLM
from celeris.tokenizer import special_token_ids

QWEN_KEYS = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attn.q_proj.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attn.k_proj.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attn.v_proj.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attn.o_proj.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.gate_proj.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.up_proj.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.down_proj.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# Checkpoint tensor name -> module name in SDARModel ("{i}" is the layer index): Qwen3's names.
CHECKPOINT_KEYS = QWEN_KEYS | {
    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.attn.q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.attn.k_norm.weight",
}


class BlockFormatConfig(FormatConfig):
    """``FormatConfig`` for a block-diffusion format: the mask id may come from its ``CONTRACT`` table entry
    (``contract_special_ids``) when the folder does not state it."""

    CONTRACT: DecodingContract

    @classmethod
    def from_json(cls, path: str | Path) -> Self:
        """As ``FormatConfig.from_json``, with the contract's mask token as the last source of the mask id."""
        path = Path(path)
        raw = contract_special_ids(json.loads(path.read_text()), path.parent, cls.CONTRACT)
        known = set(cls.__dataclass_fields__)
        values = {k: v for k, v in raw.items() if k in known and (v is not None or k in cls.NULLABLE)}
        values.update(special_token_ids(raw, path.parent))
        return cls(**values)


@dataclass
class SDARConfig(BlockFormatConfig):
    """The keys of SDAR's ``config.json`` (Qwen3's, plus ``block_size`` / ``mask_token_id`` where given).

    ``head_dim`` None means hidden_size // num_attention_heads. Refused rather than computed wrongly:
    ``attention_bias`` (Qwen3 then also biases ``o_proj``), ``rope_scaling``, sliding windows, an activation
    other than SiLU.
    """

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 1000000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    block_size: int | None = None
    mask_token_id: int = -1
    eos_token_id: int = -1
    pad_token_id: int = -1
    model_type: str = "sdar"

    NULLABLE = ("rope_scaling",)
    FORMAT = "SDAR"
    CONTRACT = CONTRACTS["sdar"]

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        unsupported = [
            (self.hidden_act != "silu", f"hidden_act '{self.hidden_act}' (only 'silu')"),
            (self.rope_scaling is not None, f"rope_scaling {self.rope_scaling} (only plain RoPE)"),
            (self.use_sliding_window, "use_sliding_window"),
            (self.attention_bias, "attention_bias"),
            (self.block_size is not None and self.block_size < 1, f"block_size {self.block_size}"),
        ]
        self.validate(unsupported, {"num_attention_heads * head_dim": self.num_attention_heads * self.head_dim,
                                    "num_attention_heads": self.num_attention_heads,
                                    "num_key_value_heads": self.num_key_value_heads})


class SDARModel(TransformerLM):
    """Token ids -> logits (unshifted) for SDAR checkpoints; ``block_contract`` says how to decode them."""

    def __init__(self, cfg: SDARConfig) -> None:
        super().__init__(
            vocab_size=cfg.vocab_size, embedding_rows=cfg.vocab_size, hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads, intermediate_size=cfg.intermediate_size,
            rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, qkv_bias=False,
            tie_head=cfg.tie_word_embeddings, head_dim=cfg.head_dim, qk_norm=True,
        )
        self.config = cfg
        self.block_contract = CONTRACTS["sdar"].with_block_size(cfg.block_size)
