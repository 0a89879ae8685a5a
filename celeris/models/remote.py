"""The generic backend: a folder's own modeling code, run through ``transformers`` (``trust_remote_code``).

For checkpoint formats Celeris does not implement natively. The folder's
``config.json`` names its classes in ``auto_map``; ``transformers`` imports the
folder's Python files and builds the model (``local_files_only``: nothing is
downloaded). ``RemoteModel`` wraps it in the interface the sampler expects:
``forward(input_ids, attention_mask, logits_slice)`` -> float32 logits where
row i predicts token i, and a ``config`` with the mask / end-of-text / pad ids
(from config.json, else the tokenizer files) and the context length.

Running a folder's code runs whatever it contains: the loader calls this only
when the user passed ``trust_remote_code=True``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from celeris.models.checkpoint import CheckpointError
from celeris.tokenizer import read_json, special_token_ids

# auto_map entries tried in order: a head that returns token logits first.
AUTO_CLASSES = ("AutoModelForMaskedLM", "AutoModelForCausalLM", "AutoModel")
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length", "max_seq_len")


@dataclass
class RemoteConfig:
    """What the engine reads from a remote model's config (its own config object stays on ``RemoteModel.inner``)."""

    mask_token_id: int
    eos_token_id: int
    pad_token_id: int
    max_position_embeddings: int
    vocab_size: int | None = None
    model_type: str = "remote"

    @classmethod
    def from_folder(cls, folder: Path) -> RemoteConfig:
        """Read ids and context length from config.json, falling back to the tokenizer files.

        Raises:
            CheckpointError: no mask or end-of-text id, or no context length anywhere.
        """
        raw = json.loads((folder / "config.json").read_text())
        try:
            ids = special_token_ids(raw, folder)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc
        context = next((raw[k] for k in CONTEXT_KEYS if isinstance(raw.get(k), int)), None)
        if context is None:  # tokenizers without a limit store a huge sentinel (1e30)
            limit = read_json(folder / "tokenizer_config.json").get("model_max_length")
            context = int(limit) if isinstance(limit, int | float) and limit < 1e9 else None
        if context is None:
            raise CheckpointError(
                f"{folder / 'config.json'} gives no context length (one of {', '.join(CONTEXT_KEYS)})"
            )
        return cls(max_position_embeddings=context, vocab_size=raw.get("vocab_size"),
                   model_type=str(raw.get("model_type", "remote")), **ids)


class RemoteModel(nn.Module):
    """Adapter: a ``transformers`` model as a Celeris model.

    The wrapped model must return token logits (``.logits`` or the first output)
    aligned with its input, i.e. position i scores token i. It receives the
    attention mask in the Hugging Face convention, (B, L) int64 with 1 on real
    tokens, and only when the batch has padding.
    """

    def __init__(self, inner: nn.Module, config: RemoteConfig) -> None:
        super().__init__()
        self.inner = inner
        self.config = config

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, logits_slice: slice | None = None
    ) -> torch.Tensor:
        """(B, L) ids (+ optional (B, L) bool mask, False on padding) -> (B, L', V) float32 logits."""
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None
        mask = None if attention_mask is None else attention_mask.long()
        out = self.inner(input_ids=input_ids, attention_mask=mask)
        logits = getattr(out, "logits", None)
        if logits is None:
            logits = out[0] if isinstance(out, tuple | list) else out
        if logits_slice is not None:
            logits = logits[:, logits_slice]
        return logits.float()


def load_remote(folder: Path, device: torch.device, dtype: torch.dtype | None = None) -> RemoteModel:
    """Build the folder's own model class with ``transformers`` (no download) and wrap it.

    Raises:
        CheckpointError: transformers missing, or the folder's code or weights fail to load.
    """
    try:
        import transformers
    except ImportError as exc:
        raise CheckpointError("trust_remote_code needs the 'transformers' package: pip install transformers") from exc
    config = RemoteConfig.from_folder(folder)
    auto_map = read_json(folder / "config.json").get("auto_map") or {}
    name = next((c for c in AUTO_CLASSES if c in auto_map), AUTO_CLASSES[0])
    auto_cls = getattr(transformers, name)
    # transformers 5 calls the argument ``dtype``; 4.x called it ``torch_dtype``.
    dtype_arg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    try:
        inner = auto_cls.from_pretrained(
            str(folder), trust_remote_code=True, local_files_only=True, **{dtype_arg: dtype or "auto"}
        )
    except (OSError, ValueError, ImportError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"transformers could not load '{folder}' with its remote code: {exc}") from exc
    return RemoteModel(inner.to(device).eval(), config).eval()
