"""Decoding modes: which way through the engine a request takes, and whether the model can take it.

The one registry of decoding modes (``MODES``). A mode is registered once (``register_mode``) as a
``DecodingMode``: its check (settings it cannot run on a model are refused, naming the parameter), its selection
predicate (which requests take it), the ``decoding`` value that names it (if any: then ``SamplingParams`` accepts
that value, because registering the mode adds it to ``celeris.sampling.rules.COMMIT_RULES``, the table
``SamplingParams.decoding`` is validated against) and its engine path: the object that lays out a pass, commits
its tokens and counts its token cost (``celeris.engine.path.ModePath``). The path is given as its factory; the
built-in modes, whose paths live on the engine's floor above this one, give None, and the engine's own table
(``celeris.engine.engine.BUILTIN_PATHS``) holds their paths: no class is named by a string. The built-in modes:

- ``masked``: full-attention diffusion models (Celeris, LLaDA, Dream), and a causal model decoding one token per
  step through the same path (``block_length`` 1: the autoregressive twin, a hybrid model outside ``verified``);
  the rules of ``celeris.sampling.step`` with the ``cache`` policies of ``celeris.sampling.cache``. The default:
  a request no other mode selects takes it.
- ``block``: block-diffusion models (SDAR, Fast-dLLM v2, LLaDA2.0), and a hybrid model asking for blocks
  (``block_length`` > 1); the rules of ``celeris.sampling.block``.
- ``verified``: ``decoding: "verified"`` on a causal model (drafts checked by the next-token head); the rules of
  ``celeris.sampling.verified``. Its ``decoding`` value is declared in ``COMMIT_RULES`` itself, so that
  ``SamplingParams(decoding="verified")`` validates after a bare ``import celeris``, which must not load this
  module (it imports ``celeris.models``); registering the mode checks that entry is the mode's own.

``mode_of`` picks the mode from the model and the settings; ``check_request`` refuses, with a ValueError whose
first word is the parameter, what the chosen mode cannot run on the model, and returns the mode. The reference
samplers, the engine and the serving layer all ask here; the modes' own modules never import this one.
Also the context-window checks every caller shares (``ContextLengthError``, ``check_fits_context``,
``answer_room``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from celeris.sampling.block import block_mode, check_block_support
from celeris.sampling.cache import CACHE_MODES
from celeris.sampling.params import SamplingParams, register_commit_rule, unregister_commit_rule
from celeris.sampling.rules import COMMIT_RULES, CommitRule
from celeris.sampling.verified import check_verified_support

Check = Callable[[torch.nn.Module, SamplingParams, bool], None]
Selects = Callable[[torch.nn.Module, SamplingParams], bool]
DEFAULT_MODE = "masked"  # the mode of a request no other mode selects


@dataclass(frozen=True, slots=True)
class DecodingMode:
    """One decoding mode, as ``register_mode`` takes it.

    Attributes:
        name: the mode's name (``Request.mode``, ``Engine.paths``' key).
        check: ``check(model, params, has_suffix)`` raises ValueError, its message starting with the parameter's
            name, for settings this mode cannot run on ``model`` (``has_suffix``: the request infills).
        selects: ``selects(model, params)``: whether a request with ``params`` on ``model`` takes this mode. The
            modes are asked in registration order; a request none selects takes ``DEFAULT_MODE``.
        path: the engine's path for this mode: a factory ``path(context) -> ModePath`` taking the engine's
            shared parts (``celeris.engine.path.PathContext``); None for a built-in mode (the engine's table).
        rule: the ``decoding`` value that names this mode (a ``CommitRule`` with ``fn`` None: its ``help`` and the
            settings only it reads, ``params``), added to ``COMMIT_RULES`` under ``name``; None: no such value.
    """

    name: str
    check: Check
    selects: Selects
    path: Callable[..., object] | None
    rule: CommitRule | None = None


MODES: dict[str, DecodingMode] = {}


def decoding_is(name: str) -> Selects:
    """The selection predicate of a mode named by a ``decoding`` value: requests with ``decoding == name``."""
    return lambda model, params: params.decoding == name


def register_mode(mode: DecodingMode) -> None:
    """Add a decoding mode; with a ``rule``, ``decoding=mode.name`` becomes a valid setting everywhere (CLI flag,
    HTTP field, ``SamplingParams``), read from ``COMMIT_RULES`` at call time.

    Raises:
        ValueError: the name is taken (a mode, or a ``decoding`` value that is not this mode's own rule), the
            rule has a commit function (a mode commits through its path), or it declares unknown settings.
    """
    if mode.name in MODES:
        raise ValueError(f"decoding mode '{mode.name}' is already registered")
    if mode.rule is not None:
        if mode.rule.fn is not None:
            raise ValueError(f"decoding mode '{mode.name}': its rule must have fn None (the mode's path commits)")
        if COMMIT_RULES.get(mode.name) is not mode.rule:
            register_commit_rule(mode.name, mode.rule)  # refuses a taken decoding value or an unknown setting
    MODES[mode.name] = mode


def unregister_mode(name: str) -> None:
    """Remove a mode added by ``register_mode`` and its ``decoding`` value (tests, plug-ins)."""
    mode = MODES.pop(name, None)
    if mode is not None and mode.rule is not None and COMMIT_RULES.get(name) is mode.rule:
        unregister_commit_rule(name)


def mode_of(model: torch.nn.Module, params: SamplingParams) -> str:
    """The mode (a key of ``MODES``) that decodes ``params`` on ``model``: the first registered mode whose
    ``selects`` says so (``block`` when the model has a block-diffusion contract that applies,
    ``celeris.sampling.block.block_mode``; ``verified`` for ``decoding: "verified"``; a plug-in's own), else
    ``DEFAULT_MODE``."""
    return next((m.name for m in MODES.values() if m.name != DEFAULT_MODE and m.selects(model, params)),
                DEFAULT_MODE)


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


def _always(model: torch.nn.Module, params: SamplingParams) -> bool:
    return True


# the built-in modes; the order is the order ``mode_of`` asks them in (block before verified: a block model
# asked for 'verified' is refused by the block check, naming ``decoding``)
register_mode(DecodingMode("block", _check_block, lambda model, params: block_mode(model, params) is not None,
                           None))
register_mode(DecodingMode("verified", check_verified_support, decoding_is("verified"),
                           None, rule=COMMIT_RULES["verified"]))
register_mode(DecodingMode(DEFAULT_MODE, check_masked_support, _always, None))


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
        A key of ``MODES``.

    Raises:
        ValueError: a setting the mode cannot run on this model (the message starts with the parameter:
            ``celeris.sampling.block.check_block_support``, ``celeris.sampling.verified.check_verified_support``,
            ``check_masked_support``, a plug-in mode's ``check``), DRY where it does not apply (a model that is
            not causal, a mode other than next-token and verified decoding), or a stop token id outside the
            vocabulary.
    """
    mode = mode_of(model, params)
    MODES[mode].check(model, params, has_suffix)
    if params.dry_multiplier and not (getattr(model.config, "is_causal", False) and mode in ("masked", "verified")):
        raise ValueError("dry_multiplier applies to next-token and verified decoding of an autoregressive (causal) "
                         f"model (celeris.sampling.dry), not to '{mode}' decoding of this one; set it to 0")
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
