"""A checkpoint folder on disk: its ``config.json``, its safetensors files and their headers.

The leaf of ``celeris.models`` that every backend reads a folder with: the native loader (``loader.py``), the
``transformers`` backend (``remote.py``) and the GGUF converter (``gguf.py``) all raise ``CheckpointError`` and
read ``config.json`` and the safetensors headers here, so no backend imports the dispatcher that calls it.
Nothing here builds a model or reads a weight.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint folder is missing, incomplete or does not match its config."""


@dataclass(frozen=True)
class TensorInfo:
    """Where a checkpoint tensor lives and what it is, read from the safetensors header only."""

    file: Path | None  # None: a tensor given in memory
    shape: tuple[int, ...]
    dtype: torch.dtype


def read_config(folder: Path) -> dict:
    """The folder's config.json as a dict (CheckpointError when missing or not JSON)."""
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder '{folder}' does not exist")
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"checkpoint folder '{folder}' has no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return raw


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: the shards named by model.safetensors.index.json, else model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} has no readable weight_map: {exc}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"shard '{file.name}' listed in {index.name} is missing from '{folder}'")
        return files
    single = folder / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"checkpoint folder '{folder}' has neither model.safetensors nor model.safetensors.index.json")
    return [single]


def read_headers(files: list[Path]) -> dict[str, TensorInfo]:
    """Name -> TensorInfo for every tensor in ``files`` (headers only; no weight is read)."""
    infos: dict[str, TensorInfo] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name in infos:
                        raise CheckpointError(f"tensor '{name}' is in both {infos[name].file.name} and {file.name}")
                    piece = f.get_slice(name)
                    dtype = SAFETENSORS_DTYPES.get(piece.get_dtype())
                    if dtype is None:
                        raise CheckpointError(f"tensor '{name}' in {file.name} has unsupported dtype {piece.get_dtype()}")
                    infos[name] = TensorInfo(file, tuple(piece.get_shape()), dtype)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file} is unreadable or corrupt: {exc}") from exc
    index = files[0].parent / "model.safetensors.index.json"
    if index.is_file():
        for name, shard in json.loads(index.read_text())["weight_map"].items():
            if name not in infos or infos[name].file.name != shard:
                raise CheckpointError(f"{index.name} puts tensor '{name}' in {shard}, but it is not there")
    return infos
