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

from dataclasses import dataclass

from celeris.models.config import QWEN3_KEYS, BlockFormatConfig, QwenConfig
from celeris.models.contract import CONTRACTS
from celeris.models.layers import Architecture, TransformerLM

# Checkpoint tensor name -> module name in SDARModel: Qwen3's names.
CHECKPOINT_KEYS = QWEN3_KEYS


@dataclass
class SDARConfig(BlockFormatConfig, QwenConfig):
    """The keys of SDAR's ``config.json`` (Qwen3's, plus ``block_size`` / ``mask_token_id`` where given).

    Refused besides ``QwenConfig``'s: ``attention_bias`` (Qwen3 then also biases ``o_proj``), ``block_size`` < 1.
    """

    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    rope_theta: float = 1000000.0
    attention_bias: bool = False
    block_size: int | None = None
    model_type: str = "sdar"

    FORMAT = "SDAR"
    CONTRACT = CONTRACTS["sdar"]
    BLOCK_SIZE_KEY = "block_size"

    def format_unsupported(self) -> list[tuple[bool, str]]:
        return [(self.attention_bias, "attention_bias")]

    def architecture(self) -> Architecture:
        """Qwen3: per-head q/k RMSNorm, no biases, no shift."""
        return super().architecture(qk_norm=True)


class SDARModel(TransformerLM):
    """Token ids -> logits (unshifted) for SDAR checkpoints; ``block_contract`` says how to decode them."""
