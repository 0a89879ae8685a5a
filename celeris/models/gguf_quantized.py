"""``--quantization gguf`` through the conversion cache: a GGUF's weights kept in their quantized form on disk.

The first load of a GGUF file with ``--quantization gguf`` reads the file's metadata
(``celeris.models.gguf.convert`` without the tensors), then its tensors one at a time (``quantized_state``: each
dequantized to float32, a large one in blocks of rows, quantized at the width of its GGUF block type and dropped
before the next is read; never a float32 model) and writes the *stored form* of the quantized model, the same bit
for bit as ``quantize_model(..., "gguf")`` on the float32 model, into its own cache entry (``celeris.models.cache``,
kind ``gguf``, variant ``VARIANT``), beside the float32 entry a plain load of the same file writes (the two are
keyed apart and coexist; this path never writes the float32 one). The entry holds ``config.json``,
``tokenizer.json``, ``tokenizer_config.json``, ``source.json`` (the key, the card facts, the size and SHA-256 of
every file) and ``STATE_FILE``, a safetensors file under the quantized model's module names:

- an int4 layer ``m`` (Q4_0, Q4_1, Q4_K blocks): ``m.codes`` (out, in / 2) uint8, two 4-bit codes a byte
  (``pack_nibbles``: a fixed layout, unlike the kernel's packing, which depends on the CPU's vector width) and
  ``m.scales_and_zeros`` (in / 32, out, 2) bfloat16;
- an int8 layer: ``m.qweight`` (out, in) int8 and ``m.scales`` (out,) bfloat16; ``m.bias`` (out,) bfloat16 when the
  layer has one;
- the embedding: ``embed_tokens.qweight`` (vocab, hidden) int8 and ``embed_tokens.scales`` (vocab,) float32 (a tied
  head scores through the same rows);
- every other tensor (the norms) in float32;

and, in the file's metadata under ``LAYOUT_KEY``, the layout (JSON): ``version``, each quantized module's method
(``int4``, ``int8``), and ``quantize_model``'s report. Every load, the first one included, builds the model from
this stored form (``load_entry``): the architecture on the meta device from ``config.json``, each quantized module
made from its tensors (int4 codes repacked for this machine's kernel), the rest assigned. So a later load never
dequantizes or requantizes, gives the first load's logits bit for bit, and holds only the quantized weights (its
peak memory is the quantized model's). An entry whose files do not match their recorded checksums (truncated,
altered) is removed and rebuilt (``cache.read_entry``). A cache that cannot be written: one warning line, and the
stored form is used from memory for this run.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from celeris.config import resolve_max_model_len
from celeris.models import cache, fast_ops, quantize
from celeris.models.blocks import BLOCK_TYPES, BlockEmbedding, BlockError, BlockLinear
from celeris.models.checkpoint import CheckpointError, TensorInfo, checkpoint_files, read_config, read_headers
from celeris.models.gguf import (
    PERMUTED,
    Converted,
    GGUFCheckpoint,
    convert,
    hf_name,
    hf_tensor,
    open_reader,
    read_card,
    unpermute,
)
from celeris.models.loader import (
    FORMATS,
    check_memory,
    detect_format,
    estimate_memory,
    kv_cache_bytes,
    match_tensors,
    packed_parts,
    split_part,
)
from celeris.models.quantize import (
    INT4_GROUPS,
    STORED_ROW_DIMS,
    Int8Embedding,
    Method,
    QuantizationError,
    activation_dtype,
    bind_head,
    check_device,
    check_shape,
    gguf_layer_methods,
    linear_from_stored,
    parse_method,
)

VARIANT = "gguf-q"  # the cache entry's variant: the weights as --quantization gguf keeps them
STATE_FILE = "model.safetensors"
LAYOUT_KEY = "celeris.quantization"  # safetensors metadata key of the layout (JSON)
LAYOUT_VERSION = 2  # raised when the stored form changes: an entry of another version is rebuilt
CHUNK_BYTES = 16 << 20  # float32 bytes of rows dequantized at once on a first load (the embedding: blocks of rows)
STORED_KEYS = {8: ("qweight", "scales"), 4: ("codes", "scales_and_zeros")}  # by bits; "bias" beside either


@dataclass
class QuantizedGGUF:
    """A GGUF file loaded quantized.

    Attributes:
        model: the eval-mode model, its linears and embedding quantized (``quantization_of(model) == "gguf"``).
        checkpoint: the entry folder (tokenizer, config, card), or a temporary folder when the cache is unwritable.
        report: ``quantize_model``'s report from the conversion (method, layers, weight bytes before and after).
        from_cache: whether the entry existed before this load (nothing was converted or quantized).
    """

    model: nn.Module
    checkpoint: GGUFCheckpoint
    report: dict
    from_cache: bool


def method_name(method: Method) -> str:
    """The ``--quantization`` name of a layer's int8 or int4 ``Method`` (``int8``, ``int4``, ``int4-g64``, ...)."""
    if method.bits == 8:
        return "int8"
    return next(name for name, group in INT4_GROUPS.items() if group == method.group)


def quantized_state(path: Path, converted: Converted) -> tuple[dict[str, torch.Tensor], dict]:
    """The stored form of the GGUF file ``path`` quantized as ``--quantization gguf`` does, and its layout (see the
    module docstring), read tensor by tensor without building the float32 model: each tensor is dequantized to
    float32 (``gguf.hf_tensor``, from the memory-mapped file; one bigger than ``CHUNK_BYTES`` in blocks of rows),
    quantized at its layer's method (``stored_weight``; the embedding as int8 rows, the norms kept) and dropped
    before the next is read. A fused projection's parts (q, k, v; gate, up) are quantized one at a time and joined
    along the rows (``STORED_ROW_DIMS``). Every stored tensor is computed row by row (int8 scales per row, int4
    groups within a row), so this equals, bit for bit, ``quantize_model(..., "gguf")`` on the float32 model (the
    first load before this existed; ``tests/models/test_gguf_quantized.py`` compares the two).

    Args:
        path: the ``.gguf`` file.
        converted: its small files (``convert(path, tensors=False)``); ``state`` is not read.

    Raises:
        GGUFError: a tensor name Celeris does not know, or an unsupported tensor type.
        CheckpointError: a tensor missing, unexpected, or of a shape the config does not give.
        QuantizationError: a layer the int4 kernel cannot take.
    """
    reader = open_reader(path)
    tensors = {name: t for t in reader.tensors if (name := hf_name(t, converted.config)) is not None}
    del reader  # its parsed metadata (the vocabulary) is large; the tensors keep their memory-mapped data
    with tempfile.TemporaryDirectory(prefix="celeris-gguf-") as tmp:
        converted.write_small_files(Path(tmp))
        fmt = FORMATS[detect_format(converted.config)]
        config = fmt.config_cls.from_json(Path(tmp) / "config.json")
        methods = gguf_layer_methods(Path(tmp), {name: t.tensor_type.name for name, t in tensors.items()})
    with torch.device("meta"):
        model = fmt.model_cls(config)
    targets = match_tensors(model, fmt, {n: tuple(int(d) for d in reversed(t.shape.tolist()))
                                         for n, t in tensors.items()})
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    sources: dict[str, dict[str | None, str]] = {}  # parameter -> {part: Hugging Face name}
    for name, target in targets.items():
        param, part = split_part(target)
        sources.setdefault(param, {})[part] = name
    packed = packed_parts(model)
    kinds = {param: {tensors[n].tensor_type.name for n in parts.values()} for param, parts in sources.items()}
    blocks = {param.rpartition(".")[0]: kind for param, found in kinds.items() if len(found) == 1
              and (kind := next(iter(found))) in BLOCK_TYPES and param.endswith(".weight")
              and (param.rpartition(".")[0] in linears or param == "embed_tokens.weight")}
    chosen = {name: methods.get(name, parse_method("int8")) for name in linears if name not in blocks}
    for name in chosen:
        check_shape(chosen[name], name, linears[name])
    if "lm_head" in linears and linears["lm_head"].out_features != model.vocab_size:
        raise QuantizationError(f"--quantization gguf: the head has {linears['lm_head'].out_features} rows for a "
                                f"vocabulary of {model.vocab_size} (padded heads are not supported)")
    act = activation_dtype(torch.device("cpu"), torch.float32)
    stored: dict[str, torch.Tensor] = {}
    for param, parts in sources.items():
        module, _, kind = param.rpartition(".")
        names = [parts[p] for p in packed[param]] if param in packed else [parts[None]]
        if module in blocks:  # the file's blocks as they are (the weight), a bias in float32
            if kind == "weight":
                stored[f"{module}.blocks"] = torch.cat([raw_rows(tensors[n], n, converted.config) for n in names])
            else:
                stored[param] = torch.cat([hf_tensor(tensors[n], n, converted.config) for n in names])
        elif module in linears:
            quantizer = partial(quantize.stored_weight, method=chosen[module], act_dtype=act) if kind == "weight" \
                else partial(_bias, act_dtype=act)
            form = _join([_read(tensors[n], n, converted.config, quantizer) for n in names])
            stored.update({f"{module}.{k}": v for k, v in form.items()})
        elif param == "embed_tokens.weight":
            form = _read(tensors[names[0]], names[0], converted.config, _int8_table)
            stored.update({f"embed_tokens.{k}": v for k, v in form.items()})
        else:  # the norms, in float32
            stored[param] = hf_tensor(tensors[names[0]], names[0], converted.config)
    return stored, _layout(stored, linears, chosen, blocks, act)


def raw_rows(tensor, name: str, config: dict) -> torch.Tensor:  # noqa: ANN001 - gguf.ReaderTensor
    """One reader tensor's blocks as they are in the file: (rows, row_bytes) uint8 (a copy), a ``llama`` q/k's rows
    unpermuted (``gguf.unpermute``: a row permutation, so it moves whole rows of blocks)."""
    rows = int(tensor.shape[-1])
    data = torch.from_numpy(np.array(tensor.data, copy=True)).view(torch.uint8).reshape(rows, -1)
    if config["model_type"] in PERMUTED and ".self_attn.q_proj." in name:
        return unpermute(data, config["num_attention_heads"]).contiguous()
    if config["model_type"] in PERMUTED and ".self_attn.k_proj." in name:
        return unpermute(data, config["num_key_value_heads"]).contiguous()
    return data


def chunk_rows(tensor, name: str, config: dict, max_bytes: int) -> list[tuple[int, int] | None]:  # noqa: ANN001
    """Row ranges (start, stop) splitting the reader tensor ``tensor`` (Hugging Face name ``name``) into consecutive
    blocks of at most ``max_bytes`` in float32 (at least one row each), for ``gguf.dequantize``'s ``rows``; ``[None]``
    (the whole tensor at once) for one that is not 2-D, fits, or is a ``llama`` q/k whose rows ``gguf.hf_tensor``
    unpermutes."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    permuted = config["model_type"] in PERMUTED and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name)
    data = tensor.data
    if len(shape) != 2 or data.ndim != 2 or data.shape[0] != shape[0] or permuted or shape[0] * shape[1] * 4 <= max_bytes:
        return [None]
    step = max(1, max_bytes // (4 * shape[1]))
    return [(start, min(start + step, shape[0])) for start in range(0, shape[0], step)]


def _bias(b: torch.Tensor, act_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A linear's bias (out,) float32 as stored: in ``act_dtype``."""
    return {"bias": b.to(act_dtype)}


def _int8_table(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The embedding (V, dim) float32 as stored: int8 rows and their float32 scales (``Int8Embedding``)."""
    q, scale = quantize.int8_rows(w)
    return {"qweight": q, "scales": scale}


def _join(forms: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stored forms of consecutive row blocks as the form of all the rows (joined along ``STORED_ROW_DIMS``)."""
    if len(forms) == 1:
        return forms[0]
    return {k: torch.cat([f[k] for f in forms], dim=STORED_ROW_DIMS[k]) for k in forms[0]}


def _read(tensor, name: str, config: dict,  # noqa: ANN001 - gguf.ReaderTensor
          quantizer: Callable[[torch.Tensor], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``quantizer``'s stored form of one reader tensor (Hugging Face name ``name``), read ``CHUNK_BYTES`` of
    float32 rows at a time (``chunk_rows``), each block quantized and dropped before the next is read. Every
    quantizer here works row by row, so the joined blocks equal the whole tensor quantized at once, bit for bit."""
    return _join([quantizer(hf_tensor(tensor, name, config, rows))
                  for rows in chunk_rows(tensor, name, config, CHUNK_BYTES)])


def _layout(stored: dict[str, torch.Tensor], linears: dict[str, nn.Module], chosen: dict[str, Method],
            blocks: dict[str, str], act: torch.dtype) -> dict:
    """The layout of a stored form: each quantized linear's method, each module kept in the file's blocks (its
    block type; ``embed_tokens`` among them when the table is), and ``quantize_model``'s report (the float32 bytes
    of the linears' weights, and the bytes of the stored weights)."""
    layers = {name: method_name(chosen[name]) for name in chosen}
    before = sum(m.weight.numel() * 4 for m in linears.values())
    table = ("blocks",) if "embed_tokens" in blocks else ("qweight", "scales")
    after = sum(stored[f"embed_tokens.{k}"].numel() * stored[f"embed_tokens.{k}"].element_size() for k in table)
    for name in linears:
        if name in blocks:
            after += sum(t.numel() * t.element_size() for k in ("blocks", "bias") if (t := stored.get(f"{name}.{k}"))
                         is not None)
            continue
        keys = [k for k in (*STORED_KEYS[chosen[name].bits], "bias") if f"{name}.{k}" in stored]
        module = linear_from_stored({k: stored[f"{name}.{k}"] for k in keys}, chosen[name], act)
        after += sum(b.numel() * b.element_size() for b in module.buffers())
    report = {"method": "gguf", "layers": len(linears), "weight_bytes_before": before, "weight_bytes_after": after}
    return {"version": LAYOUT_VERSION, "method": "gguf", "layers": layers, "blocks": blocks, "report": report}


def apply_stored(model: nn.Module, state: dict[str, torch.Tensor], layout: dict, dtype: torch.dtype) -> None:
    """Make ``model`` (built on the meta device) the quantized model ``state`` and ``layout`` describe, in place:
    each layout layer and the embedding replaced by its quantized module, every other tensor assigned (floats cast
    to ``dtype``), the logits scored through the quantized head.

    Raises:
        CheckpointError: a tensor missing or left over, or a stored shape the model does not have.
    """
    act = activation_dtype(torch.device("cpu"), dtype)
    taken: set[str] = set()
    try:
        for name, kind in layout["layers"].items():
            method = parse_method(kind)
            keys = [k for k in (*STORED_KEYS[method.bits], "bias") if k != "bias" or f"{name}.bias" in state]
            form = {k: state[f"{name}.{k}"] for k in keys}
            old, module = model.get_submodule(name), linear_from_stored(form, method, act)
            if not isinstance(old, nn.Linear) or (old.out_features, old.in_features, old.bias is None) != \
                    (module.out_features, module.in_features, module.bias is None):
                raise CheckpointError(f"the stored layer '{name}' ({module.out_features} x {module.in_features}) "
                                      "does not fit the model")
            _replace(model, name, module, taken, [f"{name}.{k}" for k in keys])
        for name, kind in layout.get("blocks", {}).items():
            if name == "embed_tokens":
                continue
            old = model.get_submodule(name)
            if not isinstance(old, nn.Linear) or (old.bias is None) != (f"{name}.bias" not in state):
                raise CheckpointError(f"the stored layer '{name}' does not fit the model")
            module = BlockLinear(state[f"{name}.blocks"], kind, old.in_features, state.get(f"{name}.bias"))
            if module.out_features != old.out_features:
                raise CheckpointError(f"the stored layer '{name}' has {module.out_features} rows, not "
                                      f"{old.out_features}")
            _replace(model, name, module, taken, [f"{name}.blocks", f"{name}.bias"])
        if "embed_tokens" in layout.get("blocks", {}):
            table = BlockEmbedding(state["embed_tokens.blocks"], layout["blocks"]["embed_tokens"],
                                   model.embed_tokens.embedding_dim, dtype)
            shape, keys = (table.num_embeddings, table.embedding_dim), ("embed_tokens.blocks",)
        else:
            table = Int8Embedding.from_quantized(state["embed_tokens.qweight"], state["embed_tokens.scales"], dtype)
            shape, keys = tuple(table.qweight.shape), ("embed_tokens.qweight", "embed_tokens.scales")
    except (KeyError, AttributeError, BlockError) as exc:
        raise CheckpointError(f"the stored quantized model lacks or misfits {exc}") from None
    if tuple(shape) != tuple(model.embed_tokens.weight.shape):
        raise CheckpointError(f"the stored embedding is {tuple(shape)}, the model's "
                              f"{tuple(model.embed_tokens.weight.shape)}")
    model.embed_tokens = table
    taken.update(keys)
    # copies: a tensor read from the entry is a view of its memory-mapped file, which it would keep resident
    rest = {k: v.to(dtype, copy=True) if v.is_floating_point() else v.clone() for k, v in state.items() if k not in taken}
    missing, unexpected = model.load_state_dict(rest, strict=False, assign=True)
    own = (*layout["layers"], *layout.get("blocks", {}), "embed_tokens")
    missing = [k for k in missing if k.rpartition(".")[0] not in own]  # their own
    if missing or unexpected:
        raise CheckpointError(f"the stored quantized model does not fit: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    tied_blocks = model.lm_head is None and isinstance(table, BlockEmbedding)
    bind_head(model, act, table.head(model.vocab_size) if tied_blocks else None)
    if layout.get("blocks"):  # the block kernel's model: the small operators between its products in C too
        fast_ops.enable(model)
    model.__dict__["_celeris_quantization"] = "gguf"


def _replace(model: nn.Module, name: str, module: nn.Module, taken: set[str], keys: list[str]) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
    taken.update(keys)


def load_entry(folder: Path, dtype: torch.dtype, max_model_len: int | None = None, max_num_seqs: int = 0,
               stored: tuple[dict[str, torch.Tensor], dict] | None = None) -> tuple[nn.Module, dict]:
    """The quantized model of an entry folder (or of ``stored`` = (state, layout) in memory, with the folder's
    small files), on the CPU, its float tensors in ``dtype``; and the layout's report. The memory check counts a
    KV store of ``max_num_seqs`` rows of ``max_model_len`` tokens, as ``load_any`` does.

    Raises:
        CheckpointError: an unknown format in config.json, a layout of another version, a stored form that does not
            fit the model, or not enough memory.
    """
    kind = detect_format(read_config(folder))
    if kind is None:
        raise CheckpointError(f"{folder / 'config.json'} names no format Celeris builds")
    fmt = FORMATS[kind]
    config = fmt.config_cls.from_json(folder / "config.json")
    with torch.device("meta"):
        model = fmt.model_cls(config)
    if stored is None:
        infos = read_headers(checkpoint_files(folder))
    else:
        infos = {k: TensorInfo(None, tuple(v.shape), v.dtype) for k, v in stored[0].items()}
    kv = 0
    if max_num_seqs and getattr(model, "supports_kv_cache", False):
        tokens = resolve_max_model_len(max_model_len, config.max_position_embeddings, torch.device("cpu"))
        kv = kv_cache_bytes(model.arch, max_num_seqs, tokens, dtype)
    check_memory(estimate_memory(infos, dtype, torch.device("cpu"), kv))
    if stored is None:
        layout = read_layout(folder)
        with safe_open(folder / STATE_FILE, framework="pt", device="cpu") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
    else:
        state, layout = stored
    if layout.get("version") != LAYOUT_VERSION:
        raise CheckpointError(f"{folder / STATE_FILE} holds quantized layout version {layout.get('version')}, "
                              f"not {LAYOUT_VERSION}")
    apply_stored(model, state, layout, dtype)
    return model.eval(), layout["report"]


def read_layout(folder: Path) -> dict:
    """The layout an entry's ``STATE_FILE`` records (empty when it records none or cannot be read)."""
    try:
        with safe_open(folder / STATE_FILE, framework="pt", device="cpu") as f:
            layout = json.loads((f.metadata() or {}).get(LAYOUT_KEY, "{}"))
    except (OSError, ValueError, SafetensorError):
        return {}
    return layout if isinstance(layout, dict) else {}


def write_entry(folder: Path, converted: Converted, state: dict[str, torch.Tensor], layout: dict) -> dict:
    """Write the entry's files into ``folder``; returns the card facts for ``source.json``."""
    converted.write_small_files(folder)
    save_file(state, folder / STATE_FILE, metadata={"format": "pt", LAYOUT_KEY: json.dumps(layout)})
    return converted.card


def load(path: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
         max_model_len: int | None = None, max_num_seqs: int = 0) -> QuantizedGGUF:
    """The GGUF file ``path`` loaded with ``--quantization gguf``: from its quantized cache entry, written first
    when there is none (see the module docstring).

    Args:
        path: the ``.gguf`` file.
        device: the CPU (the model is built there; on CUDA use ``int8`` / ``int4`` on a float checkpoint).
        dtype: the dtype of the float tensors (norms) and of the embedding's dequantized rows.
        max_model_len / max_num_seqs: the engine's KV store, counted in the memory check (0 rows: weights only).

    Raises:
        QuantizationError: a device other than the CPU, or a layer shape the kernels cannot take.
        GGUFError: the file is unusable (``celeris.models.gguf.convert``).
        CheckpointError: not enough memory.
    """
    if torch.device(device).type != "cpu":
        raise QuantizationError(f"--quantization gguf builds its model on the CPU, not {torch.device(device).type}; "
                                "use --device cpu, or --quantization int8 / int4 on CUDA")
    check_device(parse_method("gguf"), device)
    folder = cache.read_entry("gguf", path, VARIANT)
    if folder is not None and read_layout(folder).get("version") != LAYOUT_VERSION:  # written by another Celeris
        cache.discard(folder)
        folder = None
    from_cache = folder is not None
    if folder is None:
        key = cache.source_key(path)
        converted = convert(path, tensors=False)
        state, layout = quantized_state(path, converted)
        info: dict = {}
        try:
            with cache.writing_entry("gguf", path, key, info, VARIANT, checksums=True) as tmp:
                info.update(write_entry(tmp, converted, state, layout))
            folder = cache.entry_path("gguf", path, key, VARIANT)
        except cache.CacheUnavailableError as exc:
            print(f"celeris: warning: {exc}; keeping '{path.name}' quantized in memory for this run", file=sys.stderr)
            tmp_dir = tempfile.TemporaryDirectory(prefix="celeris-gguf-")
            converted.write_small_files(Path(tmp_dir.name))
            model, report = load_entry(Path(tmp_dir.name), dtype, max_model_len, max_num_seqs, (state, layout))
            card = {**converted.card, "source": path.name}
            return QuantizedGGUF(model, GGUFCheckpoint(Path(tmp_dir.name), None, card, tmp_dir), report, False)
        del state  # the model is built from the entry just written, exactly as a later load builds it
    model, report = load_entry(folder, dtype, max_model_len, max_num_seqs)
    return QuantizedGGUF(model, GGUFCheckpoint(folder, card=read_card(folder)), report, from_cache)
