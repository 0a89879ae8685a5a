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

from celeris.models.contract import CONTRACTS
from celeris.models.dream import CHECKPOINT_KEYS as QWEN2_KEYS
from celeris.models.layers import TransformerLM
from celeris.models.sdar import BlockFormatConfig

CHECKPOINT_KEYS = dict(QWEN2_KEYS)  # Qwen2's names, as Dream's


@dataclass
class FastDLLMConfig(BlockFormatConfig):
    """The keys of Fast-dLLM v2's ``config.json`` (Qwen2's plus ``bd_size``). Refused: ``rope_scaling``,
    sliding windows (``use_sliding_window``, or a ``layer_types`` entry other than ``full_attention``), an
    activation other than SiLU."""

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int | None = 4
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 1000000.0
    rope_scaling: dict | None = None
    use_sliding_window: bool = False
    layer_types: list | None = None
    bd_size: int | None = None
    mask_token_id: int = -1
    eos_token_id: int = -1
    pad_token_id: int = -1
    model_type: str = "Fast_dLLM_Qwen"

    NULLABLE = ("rope_scaling",)
    FORMAT = "Fast-dLLM v2"
    CONTRACT = CONTRACTS["fast_dllm_v2"]

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        windows = [t for t in self.layer_types or [] if t != "full_attention"]
        unsupported = [
            (self.hidden_act != "silu", f"hidden_act '{self.hidden_act}' (only 'silu')"),
            (self.rope_scaling is not None, f"rope_scaling {self.rope_scaling} (only plain RoPE)"),
            (self.use_sliding_window or bool(windows), "sliding-window attention"),
            (self.bd_size is not None and self.bd_size < 1, f"bd_size {self.bd_size}"),
        ]
        self.validate(unsupported, {"hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
                                    "num_key_value_heads": self.num_key_value_heads})


class FastDLLMModel(TransformerLM):
    """Token ids -> shifted logits for Fast-dLLM v2 checkpoints; ``block_contract`` says how to decode them."""

    logits_shift = 1  # logits[i] = head(h[i-1]); position 0 keeps head(h[0])

    def __init__(self, cfg: FastDLLMConfig) -> None:
        super().__init__(
            vocab_size=cfg.vocab_size, embedding_rows=cfg.vocab_size, hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads, intermediate_size=cfg.intermediate_size,
            rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, qkv_bias=True,
            tie_head=cfg.tie_word_embeddings,
        )
        self.config = cfg
        self.block_contract = CONTRACTS["fast_dllm_v2"].with_block_size(cfg.bd_size)
