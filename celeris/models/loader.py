"""Checkpoint folders: one loader for every native format, and saving Celeris checkpoints.

``load_any(path, device, dtype)`` reads the folder's ``config.json``, finds its format in ``FORMATS`` (the
Celeris format is one entry beside LLaDA, Dream, the block-diffusion formats SDAR, Fast-dLLM v2 and LLaDA2.0, and
the next-token formats Llama, Qwen2 and Qwen3)
and builds the shared transformer (``celeris.models.layers.TransformerLM``) with the format's config class;
anything else runs the folder's own modeling code through ``transformers`` (``remote.py``), and only when the
caller passes ``trust_remote_code=True``.

A folder holds ``config.json``, ``tokenizer.json`` (+ ``tokenizer_config.json``, ``generation_config.json``)
and one ``model.safetensors`` or the shards listed in ``model.safetensors.index.json``. Loading builds the
model on the meta device, reads the safetensors headers, renames each checkpoint tensor with the format's
``CHECKPOINT_KEYS`` table (data, not code; a target ending in ``[part]`` is one row block of a fused
projection, e.g. ``q`` of ``qkv_proj``), checks every name and shape against the config before reading any
weight, checks the memory need against what the device has free, reads the tensors, packs the parts into the
fused projections in the order the module declares (``parts()``: q, k, v; gate, up; as nano-vllm's packed
modules and gpt-fast's load hook do), then ``load_state_dict(assign=True)``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from celeris.config import resolve_max_model_len
from celeris.models import celeris, dream, fast_dllm, llada, llada2, llama, qwen, sdar
from celeris.models.checkpoint import CheckpointError, TensorInfo, checkpoint_files, read_config, read_headers
from celeris.models.layers import Architecture
from celeris.models.remote import load_remote
from celeris.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Format:
    """A natively supported checkpoint format: how to recognise it and what to build."""

    name: str
    model_types: tuple[str, ...]  # config.json "model_type" values, compared lower-case
    architectures: tuple[str, ...]  # config.json "architectures" entries
    config_cls: type
    model_cls: Callable[..., nn.Module]
    checkpoint_keys: dict[str, str]  # checkpoint tensor name pattern -> module name pattern (+ "[part]")


FORMATS = {
    "celeris": Format("celeris", ("celeris",), ("CelerisForMaskedDiffusion",), celeris.CelerisConfig,
                      celeris.CelerisModel, celeris.CHECKPOINT_KEYS),
    "llada": Format("llada", ("llada",), ("LLaDAModelLM",), llada.LLaDAConfig, llada.LLaDAModel, llada.CHECKPOINT_KEYS),
    "dream": Format("dream", ("dream",), ("DreamModel",), dream.DreamConfig, dream.DreamModel, dream.CHECKPOINT_KEYS),
    # block diffusion (celeris.models.contract): SDAR (Qwen3 layout), Fast-dLLM v2 (Qwen2.5 layout)
    "sdar": Format("sdar", ("sdar",), ("SDARForCausalLM",), sdar.SDARConfig, sdar.SDARModel, sdar.CHECKPOINT_KEYS),
    "fast_dllm_v2": Format("fast_dllm_v2", ("fast_dllm_qwen",), ("Fast_dLLM_QwenForCausalLM",),
                           fast_dllm.FastDLLMConfig, fast_dllm.FastDLLMModel, fast_dllm.CHECKPOINT_KEYS),
    "llada2": Format("llada2", ("llada2_moe",), ("LLaDA2MoeModelLM",), llada2.LLaDA2Config, llada2.LLaDA2Model,
                     llada2.CHECKPOINT_KEYS),
    # next-token checkpoints (celeris.models.causal), decoded as the autoregressive twin is
    "llama": Format("llama", ("llama",), ("LlamaForCausalLM",), llama.LlamaConfig, llama.LlamaModel,
                    llama.CHECKPOINT_KEYS),
    "qwen2": Format("qwen2", ("qwen2",), ("Qwen2ForCausalLM",), qwen.Qwen2Config, qwen.Qwen2Model,
                    qwen.QWEN2_CHECKPOINT_KEYS),
    "qwen3": Format("qwen3", ("qwen3",), ("Qwen3ForCausalLM",), qwen.Qwen3Config, qwen.Qwen3Model,
                    qwen.QWEN3_CHECKPOINT_KEYS),
}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a model needs once loaded and bytes free: ``need_bytes`` = the weights (parameters x bytes per element
    of the load dtype) + ``kv_cache_bytes``, the KV store of ``max_num_seqs`` rows of ``max_model_len`` tokens
    (``kv_cache_bytes()``)."""

    need_bytes: int
    available_bytes: int | None
    device: str
    kv_cache_bytes: int = 0

    def __str__(self) -> str:
        free = "unknown" if self.available_bytes is None else f"{self.available_bytes / 2**30:.2f} GiB"
        what = "weights" if not self.kv_cache_bytes else \
            f"weights and KV store ({self.kv_cache_bytes / 2**30:.2f} GiB; lower --max-model-len to shrink it)"
        return f"{what} need about {self.need_bytes / 2**30:.2f} GiB on {self.device}; free: {free}"


# ---------------------------------------------------------------- format detection


def detect_format(raw: dict) -> str | None:
    """A key of FORMATS, or None for a format Celeris does not implement."""
    model_type = str(raw.get("model_type", "")).lower()
    architectures = raw.get("architectures") or []
    for fmt in FORMATS.values():
        if model_type in fmt.model_types or any(a in fmt.architectures for a in architectures):
            return fmt.name
    return None


def supported_types() -> str:
    """The model_type values Celeris implements, for error messages."""
    return ", ".join(t for f in FORMATS.values() for t in f.model_types)


# ---------------------------------------------------------------- memory


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device``: CUDA's free bytes, else the host's available memory (psutil or /proc/meminfo)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_dtype(infos: dict[str, TensorInfo], dtype: torch.dtype | None) -> torch.dtype:
    """``dtype``, or else the floating dtype that holds most of the checkpoint's bytes."""
    if dtype is not None:
        return dtype
    totals: dict[torch.dtype, int] = {}
    for info in infos.values():
        if info.dtype.is_floating_point:
            totals[info.dtype] = totals.get(info.dtype, 0) + _numel(info.shape) * info.dtype.itemsize
    return max(totals, key=totals.__getitem__) if totals else torch.float32


def kv_cache_bytes(arch: Architecture, num_rows: int, num_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of a KV store of ``num_rows`` rows of ``num_tokens`` tokens: keys and values of every layer, each
    (rows, K/V heads, tokens, head_dim) in ``dtype`` (grouped-query attention stores the K/V heads only)."""
    return 2 * arch.num_layers * num_rows * arch.num_kv_heads * num_tokens * arch.head_dim * dtype.itemsize


def estimate_memory(infos: dict[str, TensorInfo], dtype: torch.dtype, device: torch.device,
                    kv_bytes: int = 0) -> MemoryEstimate:
    """The weights' bytes in ``dtype`` (integer tensors keep theirs) plus ``kv_bytes``, and what ``device`` has free."""
    need = sum(_numel(i.shape) * (dtype if i.dtype.is_floating_point else i.dtype).itemsize for i in infos.values())
    return MemoryEstimate(need + kv_bytes, available_bytes(device), str(device), kv_bytes)


def check_memory(estimate: MemoryEstimate) -> None:
    """Log the estimate; raise CheckpointError when it exceeds the free memory."""
    log.info("%s", estimate)
    if estimate.available_bytes is not None and estimate.need_bytes > estimate.available_bytes:
        raise CheckpointError(
            f"not enough memory to load this checkpoint: {estimate}. Free memory, pick another device "
            f"or a smaller dtype (e.g. bfloat16)"
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------- renaming and packing


INDEXES = ("i", "e")  # "{i}": a layer index; "{e}": an expert index (mixture-of-experts formats)


def _pattern(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for key in INDEXES:
        pattern = pattern.replace(re.escape("{" + key + "}"), rf"(?P<{key}>\d+)")
    return re.compile(pattern + "$")


def rename(name: str, table: dict[str, str]) -> str | None:
    """Map ``name`` through a ``{pattern: target}`` table ("{i}" matches a layer index, "{e}" an expert index);
    None if no pattern fits."""
    for source, target in table.items():
        match = _pattern(source).match(name)
        if match:
            for key, value in match.groupdict().items():
                target = target.replace("{" + key + "}", value)
            return target
    return None


def split_part(target: str) -> tuple[str, str | None]:
    """``"layers.0.attn.qkv_proj.weight[q]"`` -> (``"layers.0.attn.qkv_proj.weight"``, ``"q"``); no part: None."""
    if target.endswith("]") and "[" in target:
        name, _, part = target[:-1].rpartition("[")
        return name, part
    return target, None


def packed_parts(model: nn.Module) -> dict[str, dict[str, int]]:
    """Parameter name of each fused projection (e.g. ``layers.0.attn.qkv_proj.weight`` and its ``.bias``) ->
    {part: rows} in stacking order, from the modules' ``parts()``."""
    found = {}
    for prefix, module in model.named_modules():
        if hasattr(module, "parts"):
            for child, rows in module.parts().items():
                for kind in ("weight", "bias"):
                    found[f"{prefix}.{child}.{kind}"] = rows
    return found


def expected_shapes(model: nn.Module, targets: set[str]) -> dict[str, tuple[int, ...]]:
    """The shape each table target must have: a parameter's, or a part's rows of a fused one when the table
    loads it in parts (any target of the parameter names a part)."""
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    split = {split_part(t)[0] for t in targets if split_part(t)[1] is not None}
    shapes = {}
    for name, shape in state.items():
        if name in split:
            for part, rows in packed_parts(model)[name].items():
                shapes[f"{name}[{part}]"] = (rows, *shape[1:])
        else:
            shapes[name] = shape
    return shapes


def pack(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each fused projection's parts (``name[part]``) stacked along dim 0 in ``parts()`` order."""
    parts = packed_parts(model)
    pieces: dict[str, dict[str, torch.Tensor]] = {}
    packed = {}
    for target, tensor in state.items():
        name, part = split_part(target)
        if part is None:
            packed[name] = tensor
        else:
            pieces.setdefault(name, {})[part] = tensor
    for name, got in pieces.items():
        packed[name] = torch.cat([got[part] for part in parts[name]], dim=0)
    return packed


# ---------------------------------------------------------------- loading


def match_tensors(model: nn.Module, fmt: Format, shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Checkpoint name -> module name (+ ``"[part]"``) of every tensor in ``shapes`` (checkpoint name -> shape),
    checked against ``model`` (built on any device, the meta one included).

    Raises:
        CheckpointError: a tensor the format does not have, of the wrong shape (named with both shapes), or one the
            model needs that is missing.
    """
    targets: dict[str, str] = {}  # checkpoint name -> module name (+ "[part]")
    for name in shapes:
        target = rename(name, fmt.checkpoint_keys)
        if target is None:
            raise CheckpointError(
                f"unexpected tensor '{name}' in the checkpoint: not part of the {fmt.name} format for this config"
            )
        targets[name] = target
    expected = expected_shapes(model, set(targets.values()))
    order = {target: i for i, target in enumerate(expected)}  # report the model's first mismatch first
    for name, shape in sorted(shapes.items(), key=lambda item: order.get(targets[item[0]], -1)):
        if targets[name] not in expected:
            raise CheckpointError(
                f"unexpected tensor '{name}' in the checkpoint: not part of the {fmt.name} format for this config"
            )
        if shape != expected[targets[name]]:
            raise CheckpointError(
                f"tensor '{name}' has shape {shape} in the checkpoint but the config needs {expected[targets[name]]}"
            )
    missing = sorted(set(expected) - set(targets.values()))
    if missing:
        back = {target: source for source, target in fmt.checkpoint_keys.items()}
        raise CheckpointError(
            f"tensor '{rename(missing[0], back) or missing[0]}' is missing from the checkpoint (expected shape "
            f"{expected[missing[0]]}; {len(missing)} missing in all)"
        )
    return targets


def load_native(folder: Path, fmt: Format, device: torch.device, dtype: torch.dtype | None,
                kv_rows: int = 0, max_model_len: int | None = None,
                tensors: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Build ``fmt``'s model from the folder's config.json and safetensors files (see the module docstring), or
    from ``tensors`` (checkpoint name -> tensor, e.g. a GGUF converted in memory) instead of the files;
    the memory check counts a KV store of ``kv_rows`` rows of ``max_model_len`` tokens
    (``celeris.config.resolve_max_model_len``: None is the model's context, capped on a CPU)."""
    try:
        config = fmt.config_cls.from_json(folder / "config.json")
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{folder / 'config.json'} is not a usable {fmt.name} config: {exc}") from exc
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"checkpoint folder '{folder}' has no tokenizer.json")
    if tensors is None:
        infos = read_headers(checkpoint_files(folder))
    else:
        infos = {name: TensorInfo(None, tuple(t.shape), t.dtype) for name, t in tensors.items()}
    with torch.device("meta"):
        model = fmt.model_cls(config)
    targets = match_tensors(model, fmt, {name: info.shape for name, info in infos.items()})
    dtype = load_dtype(infos, dtype)
    kv = 0
    if kv_rows and getattr(model, "supports_kv_cache", False):
        tokens = resolve_max_model_len(max_model_len, config.max_position_embeddings, device)
        kv = kv_cache_bytes(model.arch, kv_rows, tokens, dtype)
    check_memory(estimate_memory(infos, dtype, device, kv))
    state = {}
    for name, tensor in (tensors or {}).items():
        state[targets[name]] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).to(device)
    for file in sorted({i.file for i in infos.values() if i.file is not None}):
        with safe_open(file, framework="pt", device=_safetensors_device(device)) as f:
            for name in (n for n, i in infos.items() if i.file == file):
                tensor = f.get_tensor(name)
                state[targets[name]] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    model.load_state_dict(pack(model, state), assign=True)
    return model.eval()


def _safetensors_device(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def load_any(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
    max_model_len: int | None = None,
    max_num_seqs: int = 0,
    tensors: dict[str, torch.Tensor] | None = None,
) -> nn.Module:
    """Load any supported checkpoint folder as an eval-mode model that maps ids to float32 logits.

    Args:
        path: checkpoint folder with config.json.
        device: where the weights go.
        dtype: weight dtype; None keeps the checkpoint's (its dominant floating dtype).
        trust_remote_code: allow running the folder's own Python modeling code for
            formats Celeris does not implement.
        max_model_len / max_num_seqs: the engine's KV store (``max_num_seqs`` rows of ``max_model_len`` tokens),
            counted in the memory check before any weight is read; 0 rows: weights only.
        tensors: the checkpoint's tensors in memory (a native format only), read instead of its safetensors files
            (``celeris.models.gguf.prepare`` without a writable cache).

    Raises:
        CheckpointError: missing/corrupt files, a tensor missing, unexpected or of
            the wrong shape (named with both shapes), not enough memory, or an
            unsupported format without ``trust_remote_code``.
        ValueError: ``max_model_len`` exceeds the model's context window.
    """
    folder, device = Path(path), torch.device(device)
    raw = read_config(folder)
    check_not_prequantized(folder, raw)
    kind = detect_format(raw)
    if kind is not None:
        return load_native(folder, FORMATS[kind], device, dtype, max_num_seqs, max_model_len, tensors)
    if not trust_remote_code:
        raise CheckpointError(
            f"{folder / 'config.json'} has model_type '{raw.get('model_type')}' (architectures "
            f"{raw.get('architectures')}); Celeris implements only {supported_types()}. Passing "
            f"trust_remote_code=True (--trust-remote-code) would run the folder's own modeling code instead"
        )
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        infos = read_headers(checkpoint_files(folder))
        check_memory(estimate_memory(infos, load_dtype(infos, dtype), device))
    return load_remote(folder, device, dtype)


def check_not_prequantized(folder: Path, raw: dict) -> None:
    """Refuse a checkpoint whose config.json carries a ``quantization_config`` (AWQ, GPTQ, compressed-tensors,
    bitsandbytes, ...): Celeris reads float weights only and quantizes them itself (``--quantization``).

    Raises:
        CheckpointError: naming the method (``quant_method``, else ``format``, else "unnamed").
    """
    q = raw.get("quantization_config")
    if q is None:
        return
    method = (q.get("quant_method") or q.get("format") or "unnamed") if isinstance(q, dict) else "unnamed"
    raise CheckpointError(f"{folder / 'config.json'} is an already quantized checkpoint ({method}); Celeris loads "
                          "float32, float16 or bfloat16 weights and quantizes them itself: use the unquantized "
                          "checkpoint with --quantization int8 or int4")


def load_tokenizer(path: str | Path, model: nn.Module | None = None) -> Tokenizer:
    """The tokenizer of a folder (its tokenizer.json) or of a tokenizer.json file (with the tokenizer_config.json
    beside it); special tokens its tokenizer_config.json leaves out take the model config's ids.

    Raises:
        CheckpointError: no such file, or one ``tokenizers`` cannot read.
    """
    folder = Path(path)
    if not folder.is_file() and not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"checkpoint folder '{folder}' has no tokenizer.json")
    ids = None
    if model is not None:
        cfg = model.config
        ids = {"eos": cfg.eos_token_id, "mask": cfg.mask_token_id, "pad": cfg.pad_token_id}
    try:
        return Tokenizer(folder, special_ids=ids)
    except Exception as exc:  # tokenizers raises plain Exception subclasses on corrupt files
        where = folder if folder.is_file() else folder / "tokenizer.json"
        raise CheckpointError(f"{where} could not be read: {exc}") from exc


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
    """Load a Celeris checkpoint folder (``model_type`` "celeris") into an eval-mode ``CelerisModel``.

    Raises:
        CheckpointError: as ``load_any``, or the folder holds another format.
    """
    folder = Path(path)
    kind = detect_format(read_config(folder))
    if kind != "celeris":
        raise CheckpointError(f"{folder / 'config.json'} is not a Celeris checkpoint (format: {kind})")
    return load_native(folder, FORMATS["celeris"], torch.device(device), dtype)


def save_checkpoint(
    model: celeris.CelerisModel,
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    generation_config: dict | None = None,
) -> Path:
    """Write ``model`` as a checkpoint folder, copying tokenizer files from ``tokenizer_dir``.

    Files are written to a temporary sibling folder that is then renamed, so a
    crash never leaves a half-written checkpoint behind.
    """
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.config.to_json(tmp / "config.json")
    state = {k: v.detach().float().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    src = Path(tokenizer_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, tmp / name)
    if generation_config is not None:
        (tmp / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    if out.exists():
        for item in out.iterdir():  # keep hand-written files such as the model card
            if item.name not in {p.name for p in tmp.iterdir()}:
                shutil.copy(item, tmp / item.name)
        shutil.rmtree(out)
    tmp.rename(out)
    return out
