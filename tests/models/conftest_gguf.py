"""Tiny GGUF files written in-process with ``gguf.GGUFWriter``, as llama.cpp's ``convert_hf_to_gguf.py`` writes
them: a tiny random transformers model (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms) is renamed to
llama.cpp's tensor names, its q/k rows are permuted for ``llama`` only (``LlamaModel.permute``: rows of each head
as (2, head_dim / 2), axes swapped), and the metadata keys are the converter's. The tokenizer is a byte-level
BPE over the 256 byte symbols plus a few merges and ChatML specials (``tokenizer.ggml.pre`` = ``smollm``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HF_TO_GGUF = {  # transformers' names -> llama.cpp's ("{i}": the block)
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
    **{f"model.layers.{{i}}.self_attn.{p}_proj.{k}": f"blk.{{i}}.attn_{p}.{k}" for p in "qkv" for k in ("weight", "bias")},
    **{f"model.layers.{{i}}.self_attn.{p}_norm.weight": f"blk.{{i}}.attn_{p}_norm.weight" for p in "qk"},
}
RAW_ONLY = ("IQ4_NL", "Q2_K", "Q3_K")
SIZES = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0}


def byte_tokens() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types): GPT-2's byte symbols, a few merges, then ChatML specials (type 3)."""
    from tokenizers.pre_tokenizers import ByteLevel

    symbols = sorted(ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "o n"]
    tokens = symbols + [m.replace(" ", "") for m in merges] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    return tokens, merges, types


@dataclass
class Tiny:
    """A tiny random checkpoint under Hugging Face's names: ``config`` (config.json keys) and float32 ``state``."""

    arch: str
    config: dict
    state: dict[str, torch.Tensor]


def tiny_checkpoint(arch: str, tie: bool = True, seed: int = 0) -> Tiny:
    """Random float32 weights of the Llama / Qwen2 (q/k/v biases) / Qwen3 (q/k norms) layout, made without
    transformers (``tiny_hf_model`` loads them into transformers' class)."""
    tokens, _, _ = byte_tokens()
    c = {**SIZES, "vocab_size": len(tokens), "tie_word_embeddings": tie, "bos_token_id": len(tokens) - 2,
         "eos_token_id": len(tokens) - 1}
    h, d, i = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, norm: bool = False) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2 + (1.0 if norm else 0.0)

    state = {"model.embed_tokens.weight": rand(c["vocab_size"], h), "model.norm.weight": rand(h, norm=True)}
    if not tie:
        state["lm_head.weight"] = rand(c["vocab_size"], h)
    for n in range(c["num_hidden_layers"]):
        at, mlp = f"model.layers.{n}.self_attn", f"model.layers.{n}.mlp"
        state |= {f"model.layers.{n}.input_layernorm.weight": rand(h, norm=True),
                  f"model.layers.{n}.post_attention_layernorm.weight": rand(h, norm=True),
                  f"{at}.q_proj.weight": rand(q, h), f"{at}.k_proj.weight": rand(kv, h),
                  f"{at}.v_proj.weight": rand(kv, h), f"{at}.o_proj.weight": rand(h, q),
                  f"{mlp}.gate_proj.weight": rand(i, h), f"{mlp}.up_proj.weight": rand(i, h),
                  f"{mlp}.down_proj.weight": rand(h, i)}
        if arch == "qwen2":
            state |= {f"{at}.q_proj.bias": rand(q), f"{at}.k_proj.bias": rand(kv), f"{at}.v_proj.bias": rand(kv)}
        if arch == "qwen3":
            state |= {f"{at}.q_norm.weight": rand(d, norm=True), f"{at}.k_norm.weight": rand(d, norm=True)}
    return Tiny(arch, c, state)


def tiny_hf_model(tiny: Tiny) -> torch.nn.Module:
    """``tiny`` as transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` (float32)."""
    import transformers

    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
    config_cls, model_cls = (getattr(transformers, n) for n in classes[tiny.arch])
    model = model_cls(config_cls(**tiny.config)).float().eval()
    missing, unexpected = model.load_state_dict(tiny.state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if tiny.config["tie_word_embeddings"]:
        model.tie_weights()
    return model


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (``LlamaModel.permute``), written from its definition."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str) -> str:
    from celeris.models.loader import rename

    name = rename(hf_name, HF_TO_GGUF)
    assert name is not None, hf_name
    return name


def write_gguf(path: Path, tiny: Tiny, quant: dict[str, str] | None = None,
               fields: dict | None = None, drop: tuple[str, ...] = (), extra: dict | None = None) -> Path:
    """Write ``tiny`` as llama.cpp's converter would (its architecture, names, permutation, metadata keys).

    Args:
        quant: substring of a llama.cpp tensor name -> GGML type name (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)
            that ``gguf.quants.quantize`` makes; others stay F32.
        fields: metadata overrides (key -> value; None deletes it).
        drop: metadata keys to leave out (e.g. the tokenizer).
        extra: more F32 tensors by llama.cpp name (e.g. ``rope_freqs.weight``).
    """
    import gguf

    cfg, arch = SimpleNamespace(**tiny.config), tiny.arch
    tokens, merges, types = byte_tokens()
    writer = gguf.GGUFWriter(str(path), arch)
    meta = {
        f"{arch}.context_length": (cfg.max_position_embeddings, "uint32"),
        f"{arch}.embedding_length": (cfg.hidden_size, "uint32"),
        f"{arch}.block_count": (cfg.num_hidden_layers, "uint32"),
        f"{arch}.feed_forward_length": (cfg.intermediate_size, "uint32"),
        f"{arch}.attention.head_count": (cfg.num_attention_heads, "uint32"),
        f"{arch}.attention.head_count_kv": (cfg.num_key_value_heads, "uint32"),
        f"{arch}.rope.freq_base": (float(cfg.rope_theta), "float32"),
        f"{arch}.attention.layer_norm_rms_epsilon": (cfg.rms_norm_eps, "float32"),
        f"{arch}.vocab_size": (cfg.vocab_size, "uint32"),
        f"{arch}.attention.key_length": (cfg.head_dim, "uint32"),
        f"{arch}.attention.value_length": (cfg.head_dim, "uint32"),
        "general.license": ("apache-2.0", "string"),
        "tokenizer.ggml.model": ("gpt2", "string"),
        "tokenizer.ggml.pre": ("smollm", "string"),
        "tokenizer.ggml.tokens": (tokens, "strings"),
        "tokenizer.ggml.merges": (merges, "strings"),
        "tokenizer.ggml.token_type": (types, "ints"),
        "tokenizer.ggml.bos_token_id": (len(tokens) - 2, "uint32"),
        "tokenizer.ggml.eos_token_id": (len(tokens) - 1, "uint32"),
        "tokenizer.ggml.padding_token_id": (len(tokens) - 1, "uint32"),
        "tokenizer.ggml.add_bos_token": (False, "bool"),
        "tokenizer.chat_template": (CHATML, "string"),
    }
    for key, value in (fields or {}).items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    for key in drop:
        meta.pop(key, None)
    adders = {"uint32": writer.add_uint32, "float32": writer.add_float32, "string": writer.add_string,
              "bool": writer.add_bool, "strings": writer.add_array, "ints": writer.add_array}
    for key, (value, kind) in meta.items():
        adders[kind](key, value)
    for hf_name, tensor in tiny.state.items():
        name = gguf_name(hf_name)
        data = tensor.detach().float().numpy()
        if arch == "llama" and ".attn_q." in name:
            data = permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            data = permute(data, cfg.num_key_value_heads)
        kind = next((t for key, t in (quant or {}).items() if key in name), "F32") if data.ndim == 2 else "F32"
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(name, np.ascontiguousarray(data))
        elif kind == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        elif kind in RAW_ONLY:  # a type gguf.quants cannot write: random blocks of its size (tests of refusal)
            block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.random.default_rng(0).integers(0, 256, (data.shape[0], data.shape[1] // block * nbytes))
            writer.add_tensor(name, raw.astype(np.uint8), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
