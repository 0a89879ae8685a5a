"""Checkpoint folders: save and load (HF-style layout).

A checkpoint is a folder with ``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` (special tokens and a Jinja chat
template) and ``generation_config.json`` (default sampling settings). Loading
builds the model on the meta device, memory-maps the safetensors file and
assigns the tensors (``load_state_dict(assign=True)``), after checking every
name and shape.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from celeris.models.celeris import CelerisConfig, CelerisModel

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


class CheckpointError(ValueError):
    """A checkpoint folder is missing, incomplete or does not match its config."""


def check_state_dict(expected: dict[str, torch.Size], found: dict[str, torch.Tensor]) -> None:
    """Raise CheckpointError naming the first missing, unexpected or mis-shaped tensor."""
    for name, shape in expected.items():
        if name not in found:
            raise CheckpointError(f"tensor '{name}' is missing from the checkpoint (expected shape {tuple(shape)})")
        if found[name].shape != shape:
            raise CheckpointError(
                f"tensor '{name}' has shape {tuple(found[name].shape)} in the checkpoint "
                f"but the config needs {tuple(shape)}"
            )
    extra = sorted(set(found) - set(expected))
    if extra:
        raise CheckpointError(f"unexpected tensor '{extra[0]}' in the checkpoint ({len(extra)} in all)")


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> CelerisModel:
    """Load a Celeris checkpoint folder into an eval-mode model.

    Raises:
        CheckpointError: folder or file missing, unreadable config or weights,
            or any tensor missing / unexpected / of the wrong shape (the message
            names the tensor and both shapes).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder '{folder}' does not exist")
    for name in REQUIRED_FILES:
        if not (folder / name).is_file():
            raise CheckpointError(f"checkpoint folder '{folder}' has no {name}")
    try:
        config = CelerisConfig.from_json(folder / "config.json")
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{folder / 'config.json'} is not a valid Celeris config: {exc}") from exc
    try:
        state = load_file(folder / "model.safetensors", device=str(device))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{folder / 'model.safetensors'} is unreadable or corrupt: {exc}") from exc
    with torch.device("meta"):
        model = CelerisModel(config)
    check_state_dict({k: v.shape for k, v in model.state_dict().items()}, state)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, assign=True)
    return model.eval()


def save_checkpoint(
    model: CelerisModel,
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
