"""Fast-dLLM v2: the published Fast-dLLM v2 checkpoint format (Efficient-Large-Model/Fast_dLLM_v2_7B, 1.5B).

Fast-dLLM v2 (arXiv:2509.26328) is Qwen2.5-Instruct converted to block diffusion: the Qwen2 module layout
(``model.layers.N.*``, biases on the q/k/v projections, grouped K/V heads, RoPE, SwiGLU, RMSNorm), the same
tensor names as Dream. Attention is block-causal over blocks of ``bd_size`` (32; its ``eval_block_diff_mask``:
query block >= key block) and it keeps the autoregressive shift: the hidden state at i - 1 scores token i
(``forward`` applies it, so row i of the logits predicts token i, as for every Celeris model). The decoding
contract (``CONTRACTS["fast_dllm_v2"]``): sub-blocks of 8, the threshold rule at 0.9, mask ``|<MASK>|``
151665, absolute block alignment, and the block's first token committed from the history's next-token
prediction. Config keys and tensor names: ``FORMATS.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from celeris.models.config import QWEN2_KEYS, BlockFormatConfig, QwenConfig
from celeris.models.contract import CONTRACTS
from celeris.models.layers import Architecture, TransformerLM

CHECKPOINT_KEYS = QWEN2_KEYS  # Qwen2's names, as Dream's


@dataclass
class FastDLLMConfig(BlockFormatConfig, QwenConfig):
    """The keys of Fast-dLLM v2's ``config.json`` (Qwen2's plus ``bd_size``). Refused besides ``QwenConfig``'s
    (among them a ``layer_types`` entry other than ``full_attention``): ``bd_size`` < 1."""

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int | None = 4
    rope_theta: float = 1000000.0
    bd_size: int | None = None
    model_type: str = "Fast_dLLM_Qwen"

    FORMAT = "Fast-dLLM v2"
    CONTRACT = CONTRACTS["fast_dllm_v2"]
    BLOCK_SIZE_KEY = "bd_size"

    def architecture(self) -> Architecture:
        """Qwen2: biases on q/k/v; the next-token shift."""
        return super().architecture(qkv_bias=True, logits_shift=1)


class FastDLLMModel(TransformerLM):
    """Token ids -> shifted logits for Fast-dLLM v2 checkpoints; ``block_contract`` says how to decode them."""
