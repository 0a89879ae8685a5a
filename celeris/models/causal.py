"""Next-token (autoregressive) checkpoints of the Llama family: what Llama, Qwen2 and Qwen3 folders share.

A causal checkpoint (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``) runs on the one
transformer (``celeris.models.layers.TransformerLM``) with causal attention and the next-token shift (the hidden
state at i - 1 scores token i), and decodes as the embedded autoregressive twin does: next-token decoding with a
KV cache, verified decoding with prompt-lookup drafts, prefix caching, grammars.

A causal model has no mask token. The engine still marks the answer positions it has not decoded yet with one
id, so a causal config's ``mask_token_id`` is ``NO_MASK``'s placeholder, ``vocab_size``: one past the vocabulary,
so it is never a token a prompt holds or the head scores (logits have ``vocab_size`` columns, so nothing needs
banning), and ``CausalLM.embed`` embeds it as token 0 (a causal model never lets a decoded token see an
undecoded position, so what those positions hold never reaches an answer). Padding uses the end-of-text id:
padded columns are masked out of attention, and every real token stays producible, as in transformers'
``generate``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from celeris.models.layers import TransformerLM


class CausalConfig:
    """Mixin for the causal formats' config dataclasses (before ``QwenConfig`` in the bases).

    Sets ``is_causal``, the mask placeholder (``mask_token_id`` = ``vocab_size``, whatever the folder says),
    padding with the end-of-text id, scaled RoPE (``celeris.models.rope``), and transformers' reading of
    ``generation_config.json`` (``GREEDY_UNLESS_DO_SAMPLE``: greedy unless ``do_sample`` is true; ``celeris.llm``).
    """

    is_causal = True
    SCALED_ROPE = True
    GREEDY_UNLESS_DO_SAMPLE = True  # generation_config.json's sampling settings count only with do_sample true
    SPECIAL_IDS = ("eos_token_id", "pad_token_id")  # ids validated inside the vocabulary (no mask token)

    @classmethod
    def complete(cls, raw: dict, folder: Path) -> dict:
        """The placeholder as the mask id: ``vocab_size`` (the folder's, else the class default)."""
        vocab = raw.get("vocab_size") or cls.__dataclass_fields__["vocab_size"].default
        return {**raw, "mask_token_id": vocab}

    def __post_init__(self) -> None:
        self.mask_token_id = self.vocab_size
        self.pad_token_id = self.eos_token_id
        super().__post_init__()


class CausalLM(TransformerLM):
    """Token ids -> next-token logits (row i predicts token i from the hidden state at i - 1) of a causal
    checkpoint; ids >= ``vocab_size`` (the engine's placeholder for undecoded positions) embed as token 0."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, L) ids -> (B, L, hidden) embeddings; the placeholder id reads row 0."""
        return self.embed_tokens(input_ids.masked_fill(input_ids >= self.vocab_size, 0))
