"""Dream: the published Dream-v0 checkpoint format (Dream-org/Dream-v0-Base-7B and -Instruct-7B).

Dream (arXiv:2508.15487) is Qwen2.5-7B turned into a masked diffusion model:
the Qwen2 module layout (``model.layers.N.*``) with bidirectional attention.
Each layer: RMSNorm (``input_layernorm``) -> attention with RoPE, biases on the
q/k/v projections and grouped K/V heads -> residual, then RMSNorm
(``post_attention_layernorm``) -> SwiGLU MLP -> residual; a final RMSNorm and
an output head (``lm_head``, tied to the embedding when
``tie_word_embeddings``).

Dream keeps the autoregressive habit of predicting the *next* token: the hidden
state at position i-1 scores token i. ``forward`` applies that shift
(``logits[i] = head(h[i-1])``, position 0 keeps ``head(h[0])``, as Dream's own
sampler does), so the sampler sees "logits at position i predict token i" like
every other Celeris model. A KV-cache window pass (w0, w1) therefore
recomputes from w0 - 1, whose hidden state scores position w0; callers pass the
same windows as for any other model. The layers and the cache interface are
the shared ones of ``celeris.models.layers``. Config keys and tensor names:
``FORMATS.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from celeris.models.layers import FormatConfig, TransformerLM

# Checkpoint tensor name -> module name in DreamModel ("{i}" is the layer index).
CHECKPOINT_KEYS = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attn.q_proj.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "layers.{i}.attn.q_proj.bias",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attn.k_proj.weight",
    "model.layers.{i}.self_attn.k_proj.bias": "layers.{i}.attn.k_proj.bias",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attn.v_proj.weight",
    "model.layers.{i}.self_attn.v_proj.bias": "layers.{i}.attn.v_proj.bias",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attn.o_proj.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.gate_proj.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.up_proj.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.down_proj.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


@dataclass
class DreamConfig(FormatConfig):
    """The keys of Dream's ``config.json`` (field names and defaults of the published ``DreamConfig``).

    ``num_key_value_heads`` None means ``num_attention_heads``. Only plain RoPE
    (``rope_scaling`` null), SiLU and no sliding window are supported; anything
    else is refused in ``__post_init__`` rather than computed wrongly.
    """

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    use_sliding_window: bool = False
    mask_token_id: int = -1
    eos_token_id: int = -1
    pad_token_id: int = -1
    model_type: str = "Dream"

    NULLABLE = ("rope_scaling",)  # an explicit null means plain RoPE
    FORMAT = "Dream"

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        unsupported = [
            (self.hidden_act != "silu", f"hidden_act '{self.hidden_act}' (only 'silu')"),
            (self.rope_scaling is not None, f"rope_scaling {self.rope_scaling} (only plain RoPE)"),
            (self.use_sliding_window, "use_sliding_window"),
        ]
        self.validate(unsupported, {"hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
                                    "num_key_value_heads": self.num_key_value_heads})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class DreamModel(TransformerLM):
    """Token ids -> (shifted) logits for Dream checkpoints. See the module docstring for the architecture."""

    logits_shift = 1  # logits[i] = head(h[i-1]); position 0 keeps head(h[0])

    def __init__(self, cfg: DreamConfig) -> None:
        super().__init__(
            vocab_size=cfg.vocab_size, embedding_rows=cfg.vocab_size, hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads, intermediate_size=cfg.intermediate_size,
            rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, qkv_bias=True,
            tie_head=cfg.tie_word_embeddings,
        )
        self.config = cfg
