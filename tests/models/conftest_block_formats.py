"""Tiny checkpoint folders in the published block-diffusion formats (SDAR, Fast-dLLM v2), built in-process.

As ``conftest_formats``: config.json with the published keys (Qwen3's for SDAR, Qwen2's plus ``bd_size`` for
Fast-dLLM v2), safetensors with the published tensor names, a tiny byte-level BPE carrying the published
special tokens (``<|im_start|>``, ``<|im_end|>``, the mask token) and a tokenizer_config.json with a Qwen-style
chat template. Like the published SDAR folder, config.json states no mask id: it comes from the mask token.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.models.conftest_formats import random_weights, save_weights, write_tokenizer

# Qwen3-style template: tools, enable_thinking (an empty think block when thinking is off).
QWEN3_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\ntools<|im_end|>\n' }}{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}\n"
    "{%- endif %}\n"
)
SDAR_SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|MASK|>"]
FAST_DLLM_SPECIALS = ["<|im_start|>", "<|im_end|>", "|<MASK>|"]


def qwen_tokenizer_config(eos: str) -> dict:
    return {"add_prefix_space": False, "bos_token": None, "chat_template": QWEN3_CHAT_TEMPLATE, "eos_token": eos,
            "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>",
            "tokenizer_class": "Qwen2Tokenizer"}


def sdar_config(ids: dict[str, int], **overrides: object) -> dict:
    """A tiny config.json with SDAR's published keys (values as SDAR-1.7B-Chat except the sizes)."""
    config = {
        "architectures": ["SDARForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                     "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|endoftext|>"], "head_dim": 16,
        "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 48,
        "max_position_embeddings": 256, "max_window_layers": 28, "model_type": "sdar", "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.52.4", "use_cache": False, "use_sliding_window": False,
        "vocab_size": ids["__size__"],
    }
    return config | overrides


def qwen_shapes(cfg: dict, qk_norm: bool, bias: bool) -> dict[str, tuple[int, ...]]:
    """Published Qwen2 / Qwen3 tensor names and shapes for a config."""
    d, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // heads
    ff, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (heads * hd, d), p + "self_attn.k_proj.weight": (kv * hd, d),
                   p + "self_attn.v_proj.weight": (kv * hd, d), p + "self_attn.o_proj.weight": (d, heads * hd),
                   p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                   p + "mlp.down_proj.weight": (d, ff)}
        if qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        if bias:
            shapes |= {p + "self_attn.q_proj.bias": (heads * hd,), p + "self_attn.k_proj.bias": (kv * hd,),
                       p + "self_attn.v_proj.bias": (kv * hd,)}
    return shapes


def write_sdar(folder: Path, seed: int = 3, scale: float = 1.0, num_shards: int = 1,
               **overrides: object) -> tuple[dict, dict]:
    """A tiny SDAR checkpoint folder; returns (config dict, state dict under the published names).
    ``scale`` multiplies the matrices (larger: sharper logits, clearer margins between greedy choices)."""
    ids = write_tokenizer(folder, SDAR_SPECIALS, qwen_tokenizer_config("<|im_end|>"))
    cfg = sdar_config(ids, **overrides)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    state = random_weights(qwen_shapes(cfg, qk_norm=True, bias=False), seed)
    state = {k: v * scale if v.dim() == 2 else v for k, v in state.items()}
    save_weights(folder, state, num_shards)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
         "do_sample": True, "temperature": 0.0, "top_p": 1.0}))
    return cfg, state


def fast_dllm_config(ids: dict[str, int], **overrides: object) -> dict:
    """A tiny config.json with Fast-dLLM v2's published keys (values as Fast_dLLM_v2_7B except the sizes)."""
    config = {
        "architectures": ["Fast_dLLM_QwenForCausalLM"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                     "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
        "bd_size": 8, "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "hidden_act": "silu",
        "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 48,
        "layer_types": ["full_attention", "full_attention"], "max_position_embeddings": 256,
        "max_window_layers": 28, "model_type": "Fast_dLLM_Qwen", "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.53.1", "use_cache": True, "use_sliding_window": False,
        "vocab_size": ids["__size__"],
    }
    return config | overrides


def write_fast_dllm(folder: Path, seed: int = 4, scale: float = 1.0, num_shards: int = 1,
                    **overrides: object) -> tuple[dict, dict]:
    """A tiny Fast-dLLM v2 checkpoint folder; returns (config dict, state dict under the published names)."""
    ids = write_tokenizer(folder, FAST_DLLM_SPECIALS, qwen_tokenizer_config("<|im_end|>"))
    cfg = fast_dllm_config(ids, **overrides)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    state = random_weights(qwen_shapes(cfg, qk_norm=False, bias=True), seed)
    state = {k: v * scale if v.dim() == 2 else v for k, v in state.items()}
    save_weights(folder, state, num_shards)
    (folder / "generation_config.json").write_text(json.dumps(  # Qwen2.5-Instruct's end ids
        {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
         "pad_token_id": ids["<|endoftext|>"]}))
    return cfg, state


# ---------------------------------------------------------------- LLaDA2.0 (Ling 2.0 mixture of experts)

LING_CHAT_TEMPLATE = (
    "{% for message in messages %}<role>{{ message['role'] | upper }}</role>{{ message['content'] }}<|role_end|>"
    "{% endfor %}{% if add_generation_prompt %}<role>ASSISTANT</role>{% endif %}"
)
LLADA2_SPECIALS = ["<role>", "</role>", "<|role_end|>"]


def llada2_config(ids: dict[str, int], **overrides: object) -> dict:
    """A tiny config.json with LLaDA2.0's published keys (``LLaDA2MoeConfig``): 2 layers, the first dense, the
    second a mixture of 8 experts in 4 groups (2 groups kept, 2 experts per token) plus a shared expert."""
    config = {
        "architectures": ["LLaDA2MoeModelLM"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
        "eos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"], "first_k_dense_replace": 1,
        "head_dim": 8, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 48,
        "max_position_embeddings": 256, "model_type": "llada2_moe", "moe_intermediate_size": 16, "n_group": 4,
        "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "num_shared_experts": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 600000, "routed_scaling_factor": 2.5, "score_function": "sigmoid",
        "tie_word_embeddings": False, "topk_group": 2, "torch_dtype": "bfloat16", "use_bias": False,
        "use_qkv_bias": False, "vocab_size": ids["__size__"],
    }
    return config | overrides


def llada2_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Published LLaDA2.0 tensor names and shapes for a config."""
    d, heads, kv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    ff, moe, vocab = cfg["intermediate_size"], cfg["moe_intermediate_size"], cfg["vocab_size"]
    shapes = {"model.word_embeddings.weight": (vocab, d), "model.norm.weight": (d,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "attention.query_key_value.weight": ((heads + 2 * kv) * hd, d),
                   p + "attention.query_layernorm.weight": (hd,), p + "attention.key_layernorm.weight": (hd,),
                   p + "attention.dense.weight": (d, heads * hd)}
        if cfg["use_qkv_bias"]:
            shapes[p + "attention.query_key_value.bias"] = ((heads + 2 * kv) * hd,)
        if cfg["use_bias"]:
            shapes[p + "attention.dense.bias"] = (d,)
        if i < cfg["first_k_dense_replace"]:
            shapes |= {p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                       p + "mlp.down_proj.weight": (d, ff)}
            continue
        shapes |= {p + "mlp.gate.weight": (cfg["num_experts"], d), p + "mlp.gate.expert_bias": (cfg["num_experts"],)}
        if cfg["num_shared_experts"]:
            shared = moe * cfg["num_shared_experts"]
            shapes |= {p + "mlp.shared_experts.gate_proj.weight": (shared, d),
                       p + "mlp.shared_experts.up_proj.weight": (shared, d),
                       p + "mlp.shared_experts.down_proj.weight": (d, shared)}
        for e in range(cfg["num_experts"]):
            shapes |= {f"{p}mlp.experts.{e}.gate_proj.weight": (moe, d), f"{p}mlp.experts.{e}.up_proj.weight": (moe, d),
                       f"{p}mlp.experts.{e}.down_proj.weight": (d, moe)}
    return shapes


def write_llada2(folder: Path, seed: int = 5, scale: float = 1.0, num_shards: int = 1,
                 **overrides: object) -> tuple[dict, dict]:
    """A tiny LLaDA2.0 checkpoint folder; returns (config dict, state dict under the published names)."""
    tokenizer_config = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "mask_token": "<|mask|>",
                        "pad_token": "<|endoftext|>", "chat_template": LING_CHAT_TEMPLATE,
                        "tokenizer_class": "PreTrainedTokenizerFast"}
    ids = write_tokenizer(folder, LLADA2_SPECIALS, tokenizer_config)
    cfg = llada2_config(ids, **overrides)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    state = random_weights(llada2_shapes(cfg), seed)
    state = {k: v * scale if v.dim() == 2 else v for k, v in state.items()}
    save_weights(folder, state, num_shards)
    return cfg, state
