"""ModelRunner: owns the model (compiled or eager), the device and the masked path's KV pool."""

from __future__ import annotations

import torch

from celeris.engine.kv import KVPool
from celeris.engine.request import Request


class ModelRunner:
    """Owns the model (compiled once when ``enforce_eager`` is False), its device and the masked path's KV pool
    (``celeris.engine.kv.KVPool``); the passes over them are the mode paths' (``celeris.engine.masked`` for
    masked diffusion).

    Attributes:
        num_split_passes: window steps run as a shared pass plus one for the wide rows
            (``MaskedPath._window_pass``).
    """

    def __init__(self, model: torch.nn.Module, enforce_eager: bool = True, length_bucket: int = 1) -> None:
        # speed features are transforms applied here, never inside the model file
        self.model = model if enforce_eager else torch.compile(model, dynamic=True)
        self.length_bucket = length_bucket
        self.device = next(model.parameters()).device
        self.mask_id = model.config.mask_token_id
        self.pad_id = model.config.pad_token_id
        self.pool = KVPool()
        self.num_split_passes = 0  # window steps run as a shared pass plus one for the wide rows (_window_pass)

    def release(self, keep: set[Request]) -> None:
        """Free the KV-cache rows of every request not in ``keep`` (finished or aborted)."""
        self.pool.release(keep)
