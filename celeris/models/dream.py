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
same windows as for any other model. The transformer and the cache interface are
the shared ones of ``celeris.models.layers`` (q/k/v and gate/up packed into
its fused projections at load time). Config keys and tensor names:
``FORMATS.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from celeris.models.config import QWEN2_KEYS, QwenConfig
from celeris.models.layers import Architecture, TransformerLM

# Checkpoint tensor name -> module name in DreamModel: Qwen2's names.
CHECKPOINT_KEYS = QWEN2_KEYS


@dataclass
class DreamConfig(QwenConfig):
    """The keys of Dream's ``config.json`` (field names and defaults of the published ``DreamConfig``; the
    Qwen2 keys and refusals of ``QwenConfig``)."""

    num_key_value_heads: int | None = 32
    model_type: str = "Dream"

    FORMAT = "Dream"

    def architecture(self) -> Architecture:
        """Qwen2: biases on q/k/v; the next-token shift (``logits[i] = head(h[i-1])``)."""
        return super().architecture(qkv_bias=True, logits_shift=1)


class DreamModel(TransformerLM):
    """Token ids -> (shifted) logits for Dream checkpoints. See the module docstring for the architecture."""
