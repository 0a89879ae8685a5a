"""Tiny checkpoint folders in the published LLaDA and Dream formats, built in-process (no downloads).

Each folder holds what the published repos hold: ``config.json`` with the
published field names, safetensors with the published tensor names (one file,
or shards plus ``model.safetensors.index.json``), a ``tokenizer.json`` trained
here with ``celeris.train.data.train_tokenizer`` plus the format's special
tokens, and a ``tokenizer_config.json`` with a chat template.

Also the reference math the tests check the native models against, written
from the published equations in float64 with no Celeris code: RMSNorm, rotary
embeddings (Llama's rotate-half convention) and softmax attention.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from celeris.train.data import train_tokenizer

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.\n",
    "for i in range(10):\n    print(i * i)\n",
    "Hello, how are you today? I am fine, thank you.\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
] * 4

# Llama-3 style template as in LLaDA's tokenizer_config.json (uses bos_token).
LLADA_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2.5 style template as in Dream's tokenizer_config.json (tests ``tools`` and whitespace control).
DREAM_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\ntools<|im_end|>\n' }}{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if not (message.role == 'system' and loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\n' }}\n"
    "{%- endif %}\n"
)

LLADA_SPECIALS = ["<|startoftext|>", "<|mdm_mask|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
DREAM_SPECIALS = ["<|im_start|>", "<|im_end|>"]


def write_tokenizer(folder: Path, specials: list[str], tokenizer_config: dict, vocab_size: int = 300) -> dict[str, int]:
    """Train a tiny byte-level BPE, add ``specials``, write tokenizer files; returns token -> id for the specials."""
    tok = train_tokenizer(iter(TEXTS), vocab_size)
    tok.add_special_tokens(specials)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    names = ["<|endoftext|>", "<|mask|>", "<|pad|>", *specials]
    return {name: tok.token_to_id(name) for name in names} | {"__size__": tok.get_vocab_size()}


def save_weights(folder: Path, state: dict[str, torch.Tensor], num_shards: int = 1) -> None:
    """``model.safetensors``, or ``num_shards`` files plus ``model.safetensors.index.json`` (HF naming)."""
    if num_shards == 1:
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        return
    names = sorted(state)
    weight_map = {}
    for s in range(num_shards):
        shard = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: state[n] for n in names[s::num_shards]}
        save_file(part, folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 tensors: norms near 1, biases and matrices with a spread that keeps logits informative."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        if "norm" in name or name.endswith("ln_f.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            state[name] = 0.1 * torch.randn(shape, generator=g)
        else:
            state[name] = torch.randn(shape, generator=g) / math.sqrt(shape[-1]) * 1.5
    return state


def padded_batch(vocab: int, seed: int = 0, pad: int = 4, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of ``length`` random ids: a full one and one left-padded by ``pad`` (pad id 0), and the (2, length) mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, :pad] = False
    ids[1, :pad] = 0
    return ids, mask


# ---------------------------------------------------------------- LLaDA


def llada_config(ids: dict[str, int], **overrides: object) -> dict:
    """A tiny config.json with the published LLaDA field names (values as in LLaDA-8B except the sizes)."""
    vocab = ids["__size__"]
    config = {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 32,
        "embedding_dropout": 0.0, "embedding_size": (vocab + 15) // 16 * 16, "eos_token_id": ids["<|endoftext|>"],
        "flash_attention": False, "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None,
        "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
        "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": ids["<|mdm_mask|>"],
        "max_sequence_length": 64, "mlp_hidden_size": 48, "mlp_ratio": 4, "model_type": "llada",
        "multi_query_attention": None, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2,
        "pad_token_id": ids["<|endoftext|>"], "precision": "amp_bf16", "residual_dropout": 0.0,
        "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0,
        "scale_logits": False, "transformers_version": "4.46.3", "use_cache": False, "vocab_size": vocab,
        "weight_tying": False,
    }
    return config | overrides


def llada_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Published tensor names and shapes for a LLaDA config (llama block)."""
    d, hd = cfg["d_model"], cfg["d_model"] // cfg["n_heads"]
    kv, ff, emb = cfg["n_kv_heads"] * hd, cfg["mlp_hidden_size"], cfg["embedding_size"]
    shapes = {"model.transformer.wte.weight": (emb, d), "model.transformer.ln_f.weight": (d,)}
    if not cfg["weight_tying"]:
        shapes["model.transformer.ff_out.weight"] = (emb, d)
    for i in range(cfg["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        shapes |= {p + "attn_norm.weight": (d,), p + "ff_norm.weight": (d,), p + "q_proj.weight": (d, d),
                   p + "k_proj.weight": (kv, d), p + "v_proj.weight": (kv, d), p + "attn_out.weight": (d, d),
                   p + "ff_proj.weight": (ff, d), p + "up_proj.weight": (ff, d), p + "ff_out.weight": (d, ff)}
        if cfg["include_qkv_bias"]:
            shapes |= {p + "q_proj.bias": (d,), p + "k_proj.bias": (kv,), p + "v_proj.bias": (kv,)}
    return shapes


def write_llada(folder: Path, num_shards: int = 2, seed: int = 0, **overrides: object) -> tuple[dict, dict]:
    """A tiny LLaDA checkpoint folder; returns (config dict, state dict under the published names)."""
    tokenizer_config = {
        "add_bos_token": False, "bos_token": "<|startoftext|>", "clean_up_tokenization_spaces": False,
        "eos_token": {"content": "<|endoftext|>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False},
        "chat_template": LLADA_CHAT_TEMPLATE, "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }  # no mask_token and no pad_token, as in the published file: the ids live in config.json
    ids = write_tokenizer(folder, LLADA_SPECIALS, tokenizer_config)
    cfg = llada_config(ids, **overrides)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    state = random_weights(llada_shapes(cfg), seed)
    save_weights(folder, state, num_shards)
    return cfg, state


# ---------------------------------------------------------------- Dream


def dream_config(ids: dict[str, int], **overrides: object) -> dict:
    """A tiny config.json with the published Dream field names (values as in Dream-v0-7B except the sizes)."""
    config = {
        "architectures": ["DreamModel"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|endoftext|>"], "hidden_act": "silu",
        "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 48, "mask_token_id": ids["<|mask|>"],
        "max_position_embeddings": 128, "max_window_layers": 28, "model_type": "Dream", "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "pad_token_id": ids["<|endoftext|>"],
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.46.2",
        "use_cache": False, "use_sliding_window": False, "vocab_size": ids["__size__"],
    }
    return config | overrides


def dream_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Published tensor names and shapes for a Dream (Qwen2) config."""
    d, hd = cfg["hidden_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    kv, ff, vocab = cfg["num_key_value_heads"] * hd, cfg["intermediate_size"], cfg["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (d, d), p + "self_attn.q_proj.bias": (d,),
                   p + "self_attn.k_proj.weight": (kv, d), p + "self_attn.k_proj.bias": (kv,),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.v_proj.bias": (kv,),
                   p + "self_attn.o_proj.weight": (d, d), p + "mlp.gate_proj.weight": (ff, d),
                   p + "mlp.up_proj.weight": (ff, d), p + "mlp.down_proj.weight": (d, ff)}
    return shapes


def write_dream(folder: Path, num_shards: int = 1, seed: int = 1, drop_ids: tuple[str, ...] = (),
                **overrides: object) -> tuple[dict, dict]:
    """A tiny Dream checkpoint folder; ``drop_ids`` removes ``*_token_id`` keys from config.json."""
    tokenizer_config = {
        "add_prefix_space": False, "bos_token": None, "chat_template": DREAM_CHAT_TEMPLATE,
        "eos_token": "<|endoftext|>", "errors": "replace",
        "mask_token": {"content": "<|mask|>", "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False, "special": True},
        "model_max_length": 131072, "pad_token": "<|endoftext|>", "tokenizer_class": "Qwen2Tokenizer",
    }
    ids = write_tokenizer(folder, DREAM_SPECIALS, tokenizer_config)
    cfg = dream_config(ids, **overrides)
    on_disk = {k: v for k, v in cfg.items() if k not in drop_ids}
    (folder / "config.json").write_text(json.dumps(on_disk, indent=2))
    state = random_weights(dream_shapes(cfg), seed)
    save_weights(folder, state, num_shards)
    return cfg, state


# ---------------------------------------------------------------- reference math (float64, no Celeris code)


def ref_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm: x / sqrt(mean(x^2) + eps) * weight."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight.double()


def ref_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate (L, H, D) by angle pos * theta^(-2j/D) on pairs (j, j + D/2) (Llama's rotate-half layout)."""
    d = x.shape[-1]
    half = d // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)  # (D/2,)
    angle = positions.double()[:, None, None] * freq  # (L, 1, D/2)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], dim=-1)


def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ok: torch.Tensor) -> torch.Tensor:
    """Bidirectional softmax attention for one sequence: q (L, H, D), k/v (L, Hkv, D), key_ok (L,) bool -> (L, H*D).

    Query head h reads K/V head h // (H / Hkv).
    """
    length, heads, d = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(length, heads, d, dtype=torch.float64)
    for h in range(heads):
        scores = torch.einsum("id,jd->ij", q[:, h], k[:, h // group]) / math.sqrt(d)  # (L, L)
        scores = scores.masked_fill(~key_ok[None, :], float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
    return out.reshape(length, heads * d)
