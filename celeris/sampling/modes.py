"""Decoding modes: which way through the engine a request takes, and whether the model can take it.

The one module that names every mode. A request is decoded by one of:

- ``masked``: full-attention diffusion models (Celeris, LLaDA, Dream), and a causal model decoding one token per
  step through the same path (``block_length`` 1: the autoregressive twin, a hybrid model outside ``verified``);
  the rules of ``celeris.sampling.step`` with the ``cache`` policies of ``celeris.sampling.cache``.
- ``block``: block-diffusion models (SDAR, Fast-dLLM v2, LLaDA2.0), and a hybrid model asking for blocks
  (``block_length`` > 1); the rules of ``celeris.sampling.block``.
- ``verified``: ``decoding: "verified"`` on a causal model (drafts checked by the next-token head); the rules of
  ``celeris.sampling.verified``.

``mode_of`` picks the mode from the model and the settings; ``check_request`` refuses, with a ValueError whose
first word is the parameter, what the chosen mode cannot run on the model, and returns the mode. The reference
samplers, the engine and the serving layer all ask here; the modes' own modules never import this one.
Also the context-window checks every caller shares (``ContextLengthError``, ``check_fits_context``,
``answer_room``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from celeris.params import SamplingParams
from celeris.sampling.block import block_mode, check_block_support
from celeris.sampling.cache import CACHE_MODES
from celeris.sampling.verified import check_verified_support

MODES = ("masked", "block", "verified")


def mode_of(model: torch.nn.Module, params: SamplingParams) -> str:
    """The mode (one of ``MODES``) that decodes ``params`` on ``model``: ``block`` when the model has a
    block-diffusion contract that applies (``celeris.sampling.block.block_mode``: a published block model always,
    a hybrid model for ``block_length`` > 1 outside ``verified``), else ``verified`` for ``decoding: "verified"``,
    else ``masked``."""
    if block_mode(model, params) is not None:
        return "block"
    return "verified" if params.decoding == "verified" else "masked"


def check_masked_support(model: torch.nn.Module, params: SamplingParams, has_suffix: bool = False) -> None:
    """Raise ValueError when the ``masked`` mode cannot decode ``params`` on ``model``.

    A KV cache needs ``supports_kv_cache``. A causal model (the autoregressive
    twin, ``config.is_causal``) decodes one token per step: it needs
    ``block_length`` 1 (each block then takes one step, whatever ``steps`` says,
    see ``block_plan``) and the ``delayed`` cache (exact for it: each token's
    keys/values are written once, a step after it is committed) or none: the modes whose
    ``CachePolicy.exact_for_causal`` is set (``celeris.sampling.cache``); it can
    neither see a suffix (infilling) nor score a masked prompt (classifier-free
    guidance). A ``suffix_window`` cannot go with a suffix to infill.
    """
    if params.suffix_window and has_suffix:
        raise ValueError("suffix_window cannot be used with a suffix to infill (it would shift the suffix's positions)")
    policy = CACHE_MODES[params.cache]
    if policy.uses_cache and not getattr(model, "supports_kv_cache", False):
        raise ValueError(f"cache='{params.cache}' is not supported by {type(model).__name__}; use cache='none'")
    if not getattr(model.config, "is_causal", False):
        return
    if params.block_length != 1:
        raise ValueError(f"block_length must be 1 for an autoregressive (causal) model, which decodes one token "
                         f"per step; got {params.block_length}")
    if not policy.exact_for_causal:
        allowed = " or ".join(f"'{name}'" for name, p in reversed(CACHE_MODES.items()) if p.exact_for_causal)
        raise ValueError(f"cache must be {allowed} for an autoregressive (causal) model; got '{params.cache}'")
    if params.cfg_scale > 0:
        raise ValueError(f"cfg_scale must be 0 for an autoregressive (causal) model; got {params.cfg_scale}")
    if has_suffix:
        raise ValueError("suffix (infilling) needs a masked-diffusion model; this one is autoregressive (causal)")


def _check_block(model: torch.nn.Module, params: SamplingParams, has_suffix: bool) -> None:
    check_block_support(block_mode(model, params), params, has_suffix)


# mode -> its check(model, params, has_suffix): raises ValueError naming the parameter first
CHECKS: dict[str, Callable[[torch.nn.Module, SamplingParams, bool], None]] = {
    "masked": check_masked_support,
    "block": _check_block,
    "verified": check_verified_support,
}


def check_request(model: torch.nn.Module, params: SamplingParams, has_suffix: bool = False,
                  vocab_size: int | None = None) -> str:
    """The mode that decodes ``params`` on ``model`` (``mode_of``), after checking that it can.

    Args:
        model: the loaded model (its config, ``block_contract``, ``supports_kv_cache``, an attached drafter).
        params: the request's settings.
        has_suffix: the request has a suffix to infill.
        vocab_size: ids a ``stop_token_ids`` entry must stay below; None: the model config's ``vocab_size``
            (no check when it has none). The serving layer passes its tokenizer's.

    Returns:
        One of ``MODES``.

    Raises:
        ValueError: a setting the mode cannot run on this model (the message starts with the parameter:
            ``celeris.sampling.block.check_block_support``, ``celeris.sampling.verified.check_verified_support``,
            ``check_masked_support``), or a stop token id outside the vocabulary.
    """
    mode = mode_of(model, params)
    CHECKS[mode](model, params, has_suffix)
    vocab = getattr(model.config, "vocab_size", None) if vocab_size is None else vocab_size
    if vocab is not None and any(t >= vocab for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids must be ids below the vocabulary size {vocab}; got {params.stop_token_ids}")
    return mode


class ContextLengthError(ValueError):
    """A prompt (and suffix) plus ``max_tokens`` do not fit the model's context window (HTTP: 400
    ``context_length_exceeded``)."""


def check_fits_context(num_prompt: int, num_suffix: int, max_tokens: int, context_length: int,
                       what: str = "the prompt") -> None:
    """Raise ContextLengthError, naming the window and every count, when ``num_prompt`` + ``num_suffix`` +
    ``max_tokens`` tokens exceed ``context_length``; ``what`` names the prompt (e.g. "the messages")."""
    need = num_prompt + num_suffix + max_tokens
    if need > context_length:
        parts = f"{what} ({num_prompt} tokens)" + (f" and suffix ({num_suffix} tokens)" if num_suffix else "")
        raise ContextLengthError(f"this model's context window is {context_length} tokens, but {parts} plus "
                                 f"max_tokens ({max_tokens}) need {need} tokens; shorten the prompt or lower max_tokens")


def answer_room(num_prompt: int, num_suffix: int, context_length: int, what: str = "the prompt") -> int:
    """Answer tokens that fit in ``context_length`` beside ``num_prompt`` prompt and ``num_suffix`` suffix tokens.

    Raises:
        ContextLengthError: not one token fits; the message names the window and the prompt's counts, never a
            ``max_tokens`` (the caller may not have sent one).
    """
    room = context_length - num_prompt - num_suffix
    if room < 1:
        parts = f"{what} ({num_prompt} tokens)" + (f" and suffix ({num_suffix} tokens)" if num_suffix else "")
        verb = "leave" if num_suffix else "leaves"
        raise ContextLengthError(f"this model's context window is {context_length} tokens, and {parts} {verb} no "
                                 f"room for an answer; shorten the prompt")
    return room
