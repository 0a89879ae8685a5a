"""ModelRunner: owns the model (compiled or eager), the device and the engine's one KV store."""

from __future__ import annotations

from collections.abc import Callable

import torch

from celeris.engine.kv import ROW_SLACK, KVPool, KVStore
from celeris.engine.request import Request


def _entry(model: torch.nn.Module, name: str, eager: bool) -> Callable | None:
    """The model's method ``name`` (None when it has none), wrapped in ``torch.compile`` unless ``eager``; an eager
    entry looks the method up at each call, so a method replaced on the model later (a test's spy) is the one run."""
    method = getattr(model, name, None)
    if method is None:
        return None
    if eager:
        return lambda *args, **kwargs: getattr(model, name)(*args, **kwargs)
    return torch.compile(method, dynamic=True)


class ModelRunner:
    """Owns the model (compiled once when ``enforce_eager`` is False), its device and the engine's one KV store
    (``kv``: ``celeris.engine.kv.KVStore``, ``kv_rows`` rows of ``max_model_len`` + ``ROW_SLACK`` columns, with
    the layers of a DFlash drafter attached to the model beside its own), from
    which every mode path takes its rows (``pool``: the masked path's, ``celeris.engine.kv.KVPool``); the passes
    are the mode paths' (``celeris.engine.masked`` for masked diffusion). Every path calls the model through the
    runner: ``model`` (the masked path's forward), ``hidden_states`` and ``logits`` (the block path),
    ``layout_hidden_states`` and ``logits`` (the verified path), each compiled when ``enforce_eager`` is False.

    Attributes:
        num_split_passes: window steps run as a shared pass plus one for the wide rows
            (``MaskedPath._window_pass``).
    """

    def __init__(self, model: torch.nn.Module, enforce_eager: bool = True, length_bucket: int = 1,
                 kv_rows: int = 8, max_model_len: int | None = None) -> None:
        # speed features are transforms applied here, never inside the model file
        self.model = model if enforce_eager else torch.compile(model, dynamic=True)
        # the block and verified paths' entries into the same model, compiled the same way (shapes are dynamic)
        self.hidden_states = _entry(model, "hidden_states", enforce_eager)
        self.layout_hidden_states = _entry(model, "layout_hidden_states", enforce_eager)
        self.logits = _entry(model, "logits", enforce_eager)
        self.length_bucket = length_bucket
        self.device = next(model.parameters()).device
        self.mask_id = model.config.mask_token_id
        self.pad_id = model.config.pad_token_id
        self.kv = KVStore(model, kv_rows, None if max_model_len is None else max_model_len + ROW_SLACK)
        self.pool = KVPool(self.kv)  # the masked path's rows
        self.num_split_passes = 0  # window steps run as a shared pass plus one for the wide rows (_window_pass)

    def release(self, keep: set[Request]) -> None:
        """Free the KV-cache rows of every request not in ``keep`` (finished or aborted)."""
        self.pool.release(keep)
