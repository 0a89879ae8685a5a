"""ModelRunner: owns the model (compiled or eager), the device and the engine's one KV store."""

from __future__ import annotations

from collections.abc import Callable

import torch

from celeris.engine.kv import ROW_SLACK, KVPool, KVStore
from celeris.engine.request import Request
from celeris.models.layers import TransformerLM, scored_logits


def _entry(model: torch.nn.Module, name: str, eager: bool) -> Callable | None:
    """The model's method ``name`` (None when it has none), wrapped in ``torch.compile`` unless ``eager``; an eager
    entry looks the method up at each call, so a method replaced on the model later (a test's spy) is the one run."""
    method = getattr(model, name, None)
    if method is None:
        return None
    if eager:
        return lambda *args, **kwargs: getattr(model, name)(*args, **kwargs)
    return torch.compile(method, dynamic=True)


class CompiledForward:
    """``TransformerLM.forward`` with its Python run eagerly around the model's compiled ``hidden_states`` and
    ``logits``. Compiling the whole forward made dynamo guard on the Python ints of ``logits_slice`` (the masked
    path's prefill passes ``slice(prompt_len, prompt_len + block)``), so every new prompt length recompiled (guard
    ``logits_slice.start == 43``; docs/quantization.md). Here those ints only pick rows of the compiled pass's
    (B, T, d) hidden states, and the two compiled calls see tensors only (``dynamic=True``: their sizes are symbolic).

    Called as ``TransformerLM.forward`` without ``return_hidden``; returns (B, L', vocab_size) float32 logits.
    """

    def __init__(self, model: TransformerLM, hidden_states: Callable, logits: Callable) -> None:
        self.hidden_states, self.logits, self.logits_shift = hidden_states, logits, model.logits_shift

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 logits_slice: slice | None = None, cache: object = None, window: object = None,
                 logits_index: torch.Tensor | None = None) -> torch.Tensor:
        return scored_logits(self, input_ids, attention_mask, logits_slice, cache, window, logits_index)


class ModelRunner:
    """Owns the model (compiled once when ``enforce_eager`` is False), its device and the engine's one KV store
    (``kv``: ``celeris.engine.kv.KVStore``, ``kv_rows`` rows of ``max_model_len`` + ``ROW_SLACK`` columns, with
    the layers of a DFlash drafter attached to the model beside its own, and the engine's prefix cache of
    ``prefix_cache_tokens`` prompt tokens, ``kv.prefix_cache``, when not 0), from
    which every mode path takes its rows (``pool``: the masked path's, ``celeris.engine.kv.KVPool``); the passes
    are the mode paths' (``celeris.engine.masked`` for masked diffusion). Every path calls the model through the
    runner: ``model`` (the masked path's forward), ``hidden_states`` and ``logits`` (the block path),
    ``layout_hidden_states`` and ``logits`` (the verified path), each compiled when ``enforce_eager`` is False.

    Attributes:
        num_split_passes: window steps run as a shared pass plus one for the wide rows
            (``MaskedPath._window_pass``).
    """

    def __init__(self, model: torch.nn.Module, enforce_eager: bool = True, length_bucket: int = 1,
                 kv_rows: int = 8, max_model_len: int | None = None, prefix_cache_tokens: int = 0) -> None:
        # speed features are transforms applied here, never inside the model file; the entries into the model
        # (the block and verified paths', and the masked path's forward) are compiled the same way (dynamic shapes)
        self.hidden_states = _entry(model, "hidden_states", enforce_eager)
        self.layout_hidden_states = _entry(model, "layout_hidden_states", enforce_eager)
        self.logits = _entry(model, "logits", enforce_eager)
        if enforce_eager:
            self.model = model
        elif type(model).forward is TransformerLM.forward:  # compiled passes, the slice's Python outside them
            self.model = CompiledForward(model, self.hidden_states, self.logits)
        else:  # another forward (a remote-code model's) is compiled whole
            self.model = torch.compile(model, dynamic=True)
        self.length_bucket = length_bucket
        self.device = next(model.parameters()).device
        self.mask_id = model.config.mask_token_id
        self.pad_id = model.config.pad_token_id
        self.kv = KVStore(model, kv_rows, None if max_model_len is None else max_model_len + ROW_SLACK,
                          prefix_cache_tokens=prefix_cache_tokens)
        self.pool = KVPool(self.kv)  # the masked path's rows
        self.num_split_passes = 0  # window steps run as a shared pass plus one for the wide rows (_window_pass)

    def release(self, keep: set[Request]) -> None:
        """Free the KV-cache rows of every request not in ``keep`` (finished or aborted)."""
        self.pool.release(keep)
