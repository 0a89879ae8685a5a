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

The transformer is the shared ``celeris.models.layers.TransformerLM``; this file
binds the Celeris config to it. A checkpoint stores the module names as they are
(fused ``qkv_proj`` / ``gate_up_proj``), so ``CHECKPOINT_KEYS`` is the identity.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from celeris.models.config import FormatConfig
from celeris.models.contract import DecodingContract, hybrid_contract
from celeris.models.layers import Architecture, TransformerLM

# The checkpoint names are the module names ("{i}": the layer index).
CHECKPOINT_KEYS = {name: name for name in (
    "embed_tokens.weight", "norm.weight", "layers.{i}.attn_norm.weight", "layers.{i}.attn.qkv_proj.weight",
    "layers.{i}.attn.o_proj.weight", "layers.{i}.mlp_norm.weight", "layers.{i}.mlp.gate_up_proj.weight",
    "layers.{i}.mlp.down_proj.weight",
)}


@dataclass
class CelerisConfig(FormatConfig):
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

    FORMAT = "Celeris"

    def __post_init__(self) -> None:
        self.validate([], {"hidden_size": self.hidden_size, "num_heads": self.num_heads})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def block_contract(self) -> DecodingContract | None:
        """A hybrid model also decodes by plain block diffusion (celeris.sampling.block) with this contract."""
        if self.is_causal and self.draft_block_size > 0:
            return hybrid_contract(self.draft_block_size, self.mask_token_id)
        return None

    def architecture(self) -> Architecture:
        """Full heads (no grouped K/V), no biases, tied head; the causal twin shifts its logits."""
        return Architecture(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
                            num_heads=self.num_heads, num_kv_heads=self.num_heads, head_dim=self.head_dim,
                            intermediate_size=self.intermediate_size, rms_norm_eps=self.rms_norm_eps,
                            rope_theta=self.rope_theta, tie_head=True, is_causal=self.is_causal,
                            logits_shift=int(self.is_causal))

    def to_json(self, path: str | Path) -> None:
        data = {"architectures": ["CelerisForMaskedDiffusion"], **asdict(self)}
        Path(path).write_text(json.dumps(data, indent=2) + "\n")


class CelerisModel(TransformerLM):
    """Token ids -> logits. See the module docstring for the architecture; the interface is ``TransformerLM``'s
    (``forward``, ``hidden_states``, ``layout_hidden_states``, ``logits``)."""

    config: CelerisConfig

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """GPT-2 style init: N(0, std) weights, output projections scaled by 1/sqrt(2 * layers)."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                scale = (2 * self.config.num_layers) ** -0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                p.normal_(0.0, std * scale)


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
