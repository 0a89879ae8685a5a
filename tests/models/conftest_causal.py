"""Tiny next-token checkpoints built by transformers itself (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM`` on a tiny config, random weights, ``save_pretrained``) with a tiny tokenizer, in-process."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from tests.models.conftest_block_formats import QWEN3_CHAT_TEMPLATE
from tests.models.conftest_formats import TEXTS

SPECIALS = ["<|im_start|>", "<|im_end|>"]
FAMILIES = {  # family -> (config class, model class) names in transformers
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
TINY = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64}


def save_tokenizer(folder: Path):
    """A tiny byte-level BPE (ChatML specials, ``<|im_end|>`` the end of text) saved by transformers'
    ``PreTrainedTokenizerFast.save_pretrained``; returns the transformers tokenizer."""
    from transformers import PreTrainedTokenizerFast

    from celeris.train.data import train_tokenizer

    tok = train_tokenizer(iter(TEXTS), 300)
    tok.add_special_tokens(SPECIALS)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                 pad_token="<|im_end|>")
    hf.chat_template = QWEN3_CHAT_TEMPLATE
    hf.save_pretrained(folder)
    return hf


def tiny_causal(family: str, folder: Path | None = None, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A random float32 transformers model of ``family`` (TINY sizes, ``overrides`` on its config), its weights
    spread (N(0, 1.5^2 / fan_in) matrices, norms near 1) so that logits are informative; saved with
    ``save_pretrained`` into ``folder`` (with the tiny tokenizer) when given."""
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    tok = save_tokenizer(folder) if folder is not None else None
    vocab = len(tok) if tok is not None else 304
    eos = tok.eos_token_id if tok is not None else 303
    config = config_cls(**{"vocab_size": vocab, "eos_token_id": eos, "bos_token_id": eos - 1, **TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 / math.sqrt(p.shape[-1]))
    model = model.float().eval()
    model.config._attn_implementation = "eager"
    if folder is not None:
        model.save_pretrained(folder)
    return model
