"""GGUF files (llama.cpp's checkpoint format) as Celeris checkpoints: ``--model PATH.gguf``.

A GGUF file holds the metadata (architecture, sizes, tokenizer, chat template) and the tensors under llama.cpp's
names, most of them quantized. It is read with the ``gguf`` package (llama.cpp's own Python reader,
``pip install 'celeris[gguf]'``) and converted once into an ordinary Hugging Face folder in the conversion cache
(``celeris.models.cache``, kind ``gguf``): float32 ``model.safetensors`` under Hugging Face's tensor names, the
``config.json`` the metadata describes, ``tokenizer.json`` / ``tokenizer_config.json`` built from the metadata
(``celeris.models.gguf_tokenizer``) and ``source.json`` (the key, and the card facts ``/v1/models`` shows). The
folder then loads through ``celeris.models.loader.load_any`` as the ``llama`` / ``qwen2`` / ``qwen3`` causal
formats; a later load reads the cached folder only. A cache that cannot be written (read-only, full) falls back to
a conversion in memory for this process, with one warning line. ``--quantization gguf`` skips this float32 entry: it
keeps its own entry holding the quantized form (``celeris.models.gguf_quantized``).

What the conversion does, following llama.cpp's ``convert_hf_to_gguf.py`` backwards (and transformers'
``modeling_gguf_pytorch_utils.py``, the oracle of the tests):

- tensors are dequantized to float32 with ``gguf.quants.dequantize`` (types ``SUPPORTED_TYPES``; any other is
  refused naming the tensor and its type) and reshaped to the reversed GGUF dimensions (GGUF lists ``ne``
  innermost first);
- names are mapped back with ``TENSOR_NAMES`` (``token_embd`` -> ``model.embed_tokens``, ``blk.N.attn_q`` ->
  ``model.layers.N.self_attn.q_proj``, ..., ``output_norm`` -> ``model.norm``, ``output`` -> ``lm_head``);
- ``llama`` GGUFs store q/k rows permuted for llama.cpp's interleaved rotary layout (``LlamaModel.permute``:
  within each head, rows (0, d/2, 1, d/2+1, ...)); ``unpermute`` restores Hugging Face's half-split order.
  ``qwen2`` / ``qwen3`` are converted without it (their converter classes do not permute);
- ``config.json``: ``{arch}.embedding_length`` -> ``hidden_size``, ``block_count``, ``feed_forward_length``,
  ``attention.head_count`` / ``head_count_kv``, ``context_length`` -> ``max_position_embeddings``,
  ``rope.freq_base`` -> ``rope_theta``, ``rope.scaling.*`` -> ``rope_scaling`` (linear, yarn), a
  ``rope_freqs.weight`` tensor (Llama 3.1+: the converter writes the llama3 divisors, not the parameters) ->
  the llama3 ``rope_scaling`` that reproduces it (``llama3_scaling``),
  ``attention.layer_norm_rms_epsilon``, the vocabulary from ``token_embd``, ``head_dim`` from ``attn_q``'s rows,
  ``tie_word_embeddings`` when there is no ``output.weight``; special ids from ``tokenizer.ggml.*_token_id``.
  A GGUF has no ``generation_config.json``: it decodes greedily by default.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from celeris.models import cache
from celeris.models.checkpoint import CheckpointError
from celeris.models.loader import rename

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED = ("llama",)  # architectures whose q/k rows llama.cpp's converter permutes
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
CARD_FILE = "source.json"  # the cache entry's record: also the card facts (CARD_KEYS)

# llama.cpp's tensor names ("{i}": the block index) -> Hugging Face's (gguf.constants.TENSOR_NAMES, backwards)
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


class GGUFError(CheckpointError):
    """A GGUF file that cannot be used: truncated, split, an unsupported architecture or tensor type, no tokenizer."""


# ---------------------------------------------------------------- finding and reading


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: itself when it ends in ``.gguf``, the only ``.gguf`` of a folder without
    ``config.json``; None when ``path`` is not a GGUF checkpoint (an ordinary folder, or nothing).

    Raises:
        GGUFError: a split file (``-00001-of-00003.gguf``: merge it first), or a folder with several ``.gguf``.
    """
    path = Path(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        found = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if not found:
            return None
        if len(found) > 1 and not all(SPLIT.search(p.name) for p in found):
            raise GGUFError(f"'{path}' holds {len(found)} .gguf files ({', '.join(p.name for p in found)}); "
                            "name the one to load")
        path = found[0]
    elif path.suffix != ".gguf":
        return None
    split = SPLIT.search(path.name)
    if split:
        raise GGUFError(f"'{path.name}' is part {int(split[1])} of a split GGUF ({int(split[2])} parts); merge "
                        f"them into one file first: gguf-split --merge {path.name} OUT.gguf")
    if not path.is_file():
        raise GGUFError(f"GGUF file '{path}' does not exist")
    return path


def open_reader(path: Path):  # noqa: ANN201 - gguf.GGUFReader (gguf is an optional dependency)
    """A ``gguf.GGUFReader`` on ``path``.

    Raises:
        GGUFError: the ``gguf`` package is missing, or the file is not a readable GGUF (truncated, corrupt).
    """
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFError("reading GGUF files needs the gguf package: pip install 'celeris[gguf]'") from None
    try:
        return GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, struct/IndexError ... on a truncated file
        raise GGUFError(f"'{path.name}' is not a readable GGUF file (truncated or corrupt): "
                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def read_fields(reader) -> dict[str, Any]:  # noqa: ANN001 - gguf.GGUFReader
    """The metadata as plain Python values (str, int, float, bool, lists of those) keyed by the GGUF key names
    (``general.architecture``, ``tokenizer.ggml.tokens``, ...); the reader's ``GGUF.*`` header fields are left out."""
    values = {}
    for name, item in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = item.contents()
        values[name] = value.item() if isinstance(value, np.generic) else value
    return values


# ---------------------------------------------------------------- tensors


def unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (``LlamaModel.permute`` in ``convert_hf_to_gguf.py``).

    The converter reshapes the rows of each head as (2, head_dim / 2) and swaps the two axes, so rotary pairs
    sit next to each other; this swaps them back.

    Args:
        weight: (num_heads * head_dim, in_features) or (num_heads * head_dim,), any dtype.
        num_heads: the heads the rows hold (key/value heads for ``attn_k``).
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    rest = weight.shape[1:]
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def dequantize(tensor, rows: tuple[int, int] | None = None) -> torch.Tensor:  # noqa: ANN001 - gguf.ReaderTensor
    """One reader tensor as float32, shaped as Hugging Face stores it (the reversed GGUF dimensions); with ``rows``
    = (start, stop), only those rows of a 2-D tensor (``gguf_quantized.chunk_rows``: a row of GGUF blocks never
    spans two rows, so they are exactly those rows of the whole).

    Raises:
        GGUFError: a type outside ``SUPPORTED_TYPES``, or data of the wrong size.
    """
    from gguf.quants import dequantize as gguf_dequantize

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise GGUFError(f"tensor '{tensor.name}' has type {kind}, which Celeris does not dequantize (supported: "
                        f"{', '.join(SUPPORTED_TYPES)})")
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    data = tensor.data
    if rows is not None:
        data, shape = data[rows[0]:rows[1]], (rows[1] - rows[0], *shape[1:])
    try:
        values = gguf_dequantize(np.asarray(data), tensor.tensor_type).reshape(shape)
    except ValueError as exc:
        raise GGUFError(f"tensor '{tensor.name}' ({kind}) does not hold {shape} values: {exc}") from None
    return torch.from_numpy(np.array(values, dtype=np.float32, order="C"))  # a copy: the reader's data is read-only


def _field(fields: dict, key: str, default: Any = None, required: bool = True) -> Any:
    if key in fields:
        return fields[key]
    if required and default is None:
        raise GGUFError(f"the GGUF metadata has no '{key}'")
    return default


def architecture_of(fields: dict) -> str:
    """``general.architecture``, checked against ``ARCHITECTURES``.

    Raises:
        GGUFError: missing, or an architecture Celeris does not convert.
    """
    arch = str(_field(fields, "general.architecture"))
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture '{arch}' is not supported; Celeris reads {', '.join(ARCHITECTURES)}")
    return arch


def rope_scaling(fields: dict, arch: str) -> dict | None:
    """``rope_scaling`` from ``{arch}.rope.scaling.*`` (linear, yarn), or None for plain RoPE.

    Raises:
        GGUFError: another scaling type.
    """
    kind = fields.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = float(_field(fields, f"{arch}.rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor,
                   "original_max_position_embeddings": int(_field(fields, f"{arch}.rope.scaling.original_context_length"))}
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{gguf_key}" in fields:
                scaling[hf_key] = float(fields[f"{arch}.rope.scaling.{gguf_key}"])
        return scaling
    raise GGUFError(f"GGUF rope scaling type '{kind}' is not supported (only linear and yarn)")


def llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float, original: float) -> torch.Tensor:
    """The per-frequency divisors llama.cpp's converter writes as ``rope_freqs.weight`` for Llama 3.1 RoPE
    (``LlamaModel.generate_extra_tensors``; Meta's ``apply_scaling``): 1 for wavelengths under
    ``original / high``, ``factor`` over ``original / low``, a smooth blend between. Shape (head_dim / 2,), float64."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ratio = original / (2 * torch.pi / inv_freq)  # original context over each wavelength
    smooth = ((ratio - low) / (high - low)).clamp(0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def llama3_scaling(factors: torch.Tensor, theta: float, head_dim: int) -> dict | None:
    """``rope_scaling`` of type llama3 that gives exactly the divisors ``factors`` (a GGUF's ``rope_freqs.weight``).

    The divisors fix ``factor`` (the largest) and, through the blended band, the line ``smooth = a / wavelength
    + b``; with ``low_freq_factor`` 1 (every published Llama 3.x) that gives ``high_freq_factor = 1 - 1 / b`` and
    ``original_max_position_embeddings = -a / b``. The result is checked by recomputing the divisors.

    Raises:
        GGUFError: divisors no llama3 scaling produces (or too few blended ones to tell its band).
    """
    factors = factors.double().flatten()
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    x = inv_freq / (2 * torch.pi)  # 1 / wavelength
    blended = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6)
    smooth = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    if int(blended.sum()) >= 2:
        design = torch.stack([x[blended], torch.ones_like(x[blended])], dim=1)
        a, b = (float(v) for v in torch.linalg.lstsq(design, smooth[blended, None]).solution.flatten())
    else:  # no band to fit: put it anywhere between the last divided and the first kept frequency
        kept, divided = x[factors <= 1.0 + 1e-6], x[factors >= factor - 1e-6]
        if int(blended.sum()) == 1 or not len(kept) or not len(divided):
            raise GGUFError("tensor 'rope_freqs.weight' does not determine a llama3 RoPE scaling")
        lo, hi = float(divided.max()), float(kept.min())
        a = 3.0 / (hi - lo)
        b = -(lo + (hi - lo) / 3.0) * a
    if b >= 0 or a <= 0:
        raise GGUFError("tensor 'rope_freqs.weight' holds RoPE divisors no llama3 scaling produces")
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 1.0 - 1.0 / b,
               "original_max_position_embeddings": max(1, round(-a / b))}
    again = llama3_factors(theta, head_dim, factor, 1.0, scaling["high_freq_factor"],
                           scaling["original_max_position_embeddings"])
    if not torch.allclose(again, factors, rtol=1e-4, atol=1e-5):
        raise GGUFError("tensor 'rope_freqs.weight' holds RoPE divisors no llama3 scaling produces")
    return scaling


def hf_config(fields: dict, shapes: dict[str, tuple[int, ...]], rope_factors: torch.Tensor | None = None) -> dict:
    """The Hugging Face ``config.json`` the metadata describes.

    Args:
        fields: ``read_fields``' metadata.
        shapes: llama.cpp tensor name -> shape as Hugging Face stores it (``token_embd.weight``: (vocab, hidden)).
        rope_factors: the ``rope_freqs.weight`` tensor (Llama 3.1 RoPE divisors), when the file has one.

    Raises:
        GGUFError: an unsupported architecture or rope scaling, a missing key, or no ``token_embd``/``attn_q``.
    """
    arch = architecture_of(fields)
    if "token_embd.weight" not in shapes or "blk.0.attn_q.weight" not in shapes:
        raise GGUFError("the GGUF file has no 'token_embd.weight' or 'blk.0.attn_q.weight' tensor")
    if "rope_freqs.weight" in shapes and rope_factors is None:
        raise GGUFError("tensor 'rope_freqs.weight' (Llama 3 RoPE divisors) was not read")
    heads = int(_field(fields, f"{arch}.attention.head_count"))
    config = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch, "torch_dtype": "float32",
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": int(_field(fields, f"{arch}.embedding_length")),
        "intermediate_size": int(_field(fields, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(fields, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(fields.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": shapes["blk.0.attn_q.weight"][0] // heads,
        "max_position_embeddings": int(_field(fields, f"{arch}.context_length")),
        "rms_norm_eps": float(_field(fields, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling(fields, arch),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in shapes,
    }
    if rope_factors is not None:
        if config["rope_scaling"] is not None:
            raise GGUFError("the GGUF file has both rope.scaling metadata and a 'rope_freqs.weight' tensor")
        config["rope_scaling"] = llama3_scaling(rope_factors, config["rope_theta"], config["head_dim"])
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in shapes
        config["mlp_bias"] = False
    for gguf_key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("padding_token_id", "pad_token_id")):
        if f"tokenizer.ggml.{gguf_key}" in fields:
            config[hf_key] = int(fields[f"tokenizer.ggml.{gguf_key}"])
    return config


def tensor_types(path: Path) -> dict[str, str]:
    """Hugging Face tensor name -> GGUF tensor type name (``Q4_1``, ``Q8_0``, ``F32``, ...) of a GGUF file, from its
    header only (``--quantization gguf`` keeps each block type's width: ``celeris.models.quantize``).

    Raises:
        GGUFError: the file cannot be read.
    """
    reader = open_reader(path)
    return {name: t.tensor_type.name for t in reader.tensors
            if t.name != "rope_freqs.weight" and (name := rename(t.name, TENSOR_NAMES)) is not None}


def hf_name(tensor, config: dict) -> str | None:  # noqa: ANN001 - gguf.ReaderTensor
    """The Hugging Face name of one reader tensor; None for ``rope_freqs.weight`` (read into config.json).

    Raises:
        GGUFError: a tensor name outside ``TENSOR_NAMES``.
    """
    if tensor.name == "rope_freqs.weight":  # not a weight: read into config.json's rope_scaling (llama3)
        return None
    name = rename(tensor.name, TENSOR_NAMES)
    if name is None:
        raise GGUFError(f"tensor '{tensor.name}' of this {config['model_type']} GGUF has no Hugging Face "
                        "counterpart Celeris knows")
    return name


def hf_tensor(tensor, name: str, config: dict,  # noqa: ANN001 - gguf.ReaderTensor
              rows: tuple[int, int] | None = None) -> torch.Tensor:
    """One reader tensor (Hugging Face name ``name``) dequantized to float32, its q/k rows unpermuted for ``llama``;
    with ``rows``, only those rows (``gguf_quantized.chunk_rows`` never splits one that is unpermuted).

    Raises:
        GGUFError: an unsupported tensor type.
    """
    weight = dequantize(tensor, rows)
    permuted = config["model_type"] in PERMUTED
    if permuted and ".self_attn.q_proj." in name:
        weight = unpermute(weight, config["num_attention_heads"])
    elif permuted and ".self_attn.k_proj." in name:
        weight = unpermute(weight, config["num_key_value_heads"])
    return weight


def hf_state(reader, config: dict) -> dict[str, torch.Tensor]:  # noqa: ANN001 - gguf.GGUFReader
    """Every tensor dequantized to float32 under its Hugging Face name (``hf_tensor``).

    Raises:
        GGUFError: a tensor name outside ``TENSOR_NAMES``, or an unsupported tensor type.
    """
    return {name: hf_tensor(t, name, config) for t in reader.tensors if (name := hf_name(t, config)) is not None}


# ---------------------------------------------------------------- conversion


@dataclass
class Converted:
    """A GGUF file converted in memory: what a Hugging Face folder holds."""

    config: dict
    state: dict[str, torch.Tensor]  # Hugging Face name -> float32 tensor
    tokenizer_json: str
    tokenizer_config: dict
    card: dict  # CARD_KEYS facts for /v1/models

    def write_small_files(self, folder: Path) -> None:
        """config.json, tokenizer.json, tokenizer_config.json (everything but the weights)."""
        (folder / "config.json").write_text(json.dumps(self.config, indent=1) + "\n")
        (folder / "tokenizer.json").write_text(self.tokenizer_json)
        (folder / "tokenizer_config.json").write_text(json.dumps(self.tokenizer_config, indent=1) + "\n")

    def write(self, folder: Path) -> dict:
        """The whole Hugging Face folder (float32 ``model.safetensors``); returns the card facts."""
        self.write_small_files(folder)
        save_file({k: v.contiguous() for k, v in self.state.items()}, folder / "model.safetensors",
                  metadata={"format": "pt"})
        return self.card


def card_facts(fields: dict, tokenizer_config: dict) -> dict:
    """What ``/v1/models`` shows of a GGUF: format, architecture, context, add_bos/eos_token, license."""
    arch = str(fields.get("general.architecture"))
    return {"format": "gguf", "architecture": arch, "context_length": fields.get(f"{arch}.context_length"),
            "add_bos_token": bool(tokenizer_config.get("add_bos_token", False)),
            "add_eos_token": bool(tokenizer_config.get("add_eos_token", False)),
            "license": fields.get("general.license")}


def convert(path: Path, tensors: bool = True) -> Converted:
    """Read and convert one GGUF file (see the module docstring); without ``tensors``, everything but the weights
    (``state`` left empty: ``celeris.models.gguf_quantized`` reads them one at a time).

    Raises:
        GGUFError: anything that makes the file unusable, in one line.
    """
    from celeris.models.gguf_tokenizer import GGUFTokenizerError, tokenizer_config_from_gguf, tokenizer_from_gguf

    reader = open_reader(path)
    fields = read_fields(reader)
    architecture_of(fields)
    for tensor in reader.tensors:  # refuse before the (slow) dequantization
        if tensor.tensor_type.name not in SUPPORTED_TYPES:
            raise GGUFError(f"tensor '{tensor.name}' has type {tensor.tensor_type.name}, which Celeris does not "
                            f"dequantize (supported: {', '.join(SUPPORTED_TYPES)})")
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    rope = next((dequantize(t) for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    config = hf_config(fields, shapes, rope)
    try:
        tokenizer = tokenizer_from_gguf(fields)
        tokenizer_config = tokenizer_config_from_gguf(fields)
    except GGUFTokenizerError as exc:
        raise GGUFError(f"'{path.name}': {exc}") from None
    state = hf_state(reader, config) if tensors else {}
    return Converted(config, state, tokenizer.to_str(), tokenizer_config, card_facts(fields, tokenizer_config))


@dataclass
class GGUFCheckpoint:
    """A GGUF file ready to load: a Hugging Face folder, and the weights themselves when they are not in it.

    Attributes:
        folder: the cache entry, or (cache not writable) a temporary folder with the small files only.
        tensors: None when ``folder`` holds ``model.safetensors``; else the converted weights in memory.
        card: the facts ``/v1/models`` shows (``card_facts``).
    """

    folder: Path
    tensors: dict[str, torch.Tensor] | None = None
    card: dict = field(default_factory=dict)
    _tmp: tempfile.TemporaryDirectory | None = None  # keeps the temporary folder alive as long as this object


def read_card(folder: Path) -> dict:
    """The card facts a converted folder records (empty for a folder that is not a GGUF conversion)."""
    try:
        record = json.loads((folder / CARD_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: record.get(k) for k in ("format", "architecture", "context_length", "add_bos_token", "add_eos_token",
                                       "license", "source")}


def prepare(path: Path) -> GGUFCheckpoint:
    """The cached folder of the GGUF file ``path``, converting it on the first load. When the cache cannot be
    written, one warning line on stderr and a conversion kept in memory (``tensors``).

    Raises:
        GGUFError: the file is unusable (``convert``).
    """
    try:
        folder = cache.cached_or_convert("gguf", path, lambda tmp: convert(path).write(tmp))
        return GGUFCheckpoint(folder, card=read_card(folder))
    except cache.CacheUnavailableError as exc:
        print(f"celeris: warning: {exc}; converting '{path.name}' in memory for this run", file=sys.stderr)
    converted = convert(path)
    tmp = tempfile.TemporaryDirectory(prefix="celeris-gguf-")
    try:
        converted.write_small_files(Path(tmp.name))
    except OSError as exc:
        tmp.cleanup()
        raise GGUFError(f"cannot write even the tokenizer files of '{path.name}' to a temporary folder: "
                        f"{exc.strerror or exc}") from None
    card = {**converted.card, "source": path.name}
    return GGUFCheckpoint(Path(tmp.name), converted.state, card, tmp)
