"""Tiny GGUF files written in-process with ``gguf.GGUFWriter``, as llama.cpp's ``convert_hf_to_gguf.py`` writes
them: a tiny random transformers model (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms) is renamed to
llama.cpp's tensor names, its q/k rows are permuted for ``llama`` only (``LlamaModel.permute``: rows of each head
as (2, head_dim / 2), axes swapped), and the metadata keys are the converter's. The tokenizer is a byte-level
BPE over the 256 byte symbols plus a few merges and ChatML specials (``tokenizer.ggml.pre`` = ``smollm``).
"""

from __future__ import annotations

from pathlib import Path

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


def tiny_hf_model(arch: str, tie: bool = True, seed: int = 0) -> torch.nn.Module:
    """A tiny random float32 ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``."""
    import transformers

    tokens, _, _ = byte_tokens()
    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
    config_cls, model_cls = (getattr(transformers, n) for n in classes[arch])
    config = config_cls(vocab_size=len(tokens), tie_word_embeddings=tie, bos_token_id=len(tokens) - 2,
                        eos_token_id=len(tokens) - 1, **SIZES)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():  # non-trivial norms and biases too
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 and p.shape[0] <= 64 else 0.0))
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


def write_gguf(path: Path, model: torch.nn.Module, arch: str, quant: dict[str, str] | None = None,
               fields: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """Write ``model`` as a GGUF file of architecture ``arch``.

    Args:
        quant: substring of a llama.cpp tensor name -> GGML type name (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)
            that ``gguf.quants.quantize`` makes; others stay F32.
        fields: metadata overrides (key -> value; None deletes it).
        drop: metadata keys to leave out (e.g. the tokenizer).
    """
    import gguf

    cfg = model.config
    tokens, merges, types = byte_tokens()
    writer = gguf.GGUFWriter(str(path), arch)
    meta = {
        f"{arch}.context_length": (cfg.max_position_embeddings, "uint32"),
        f"{arch}.embedding_length": (cfg.hidden_size, "uint32"),
        f"{arch}.block_count": (cfg.num_hidden_layers, "uint32"),
        f"{arch}.feed_forward_length": (cfg.intermediate_size, "uint32"),
        f"{arch}.attention.head_count": (cfg.num_attention_heads, "uint32"),
        f"{arch}.attention.head_count_kv": (cfg.num_key_value_heads, "uint32"),
        f"{arch}.rope.freq_base": (float(cfg.rope_parameters["rope_theta"]), "float32"),
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
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
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
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
