"""Verified decoding's draft proposers, one per ``draft_source`` (vLLM's ``v1/spec_decode``): the interface
(``celeris.engine.proposers.base``: ``Proposer``, ``DraftAsk``, ``Drafts``), the built-ins (prompt lookup, a hybrid
model's mask slots, a DFlash drafter, and lookup-first, the default) and the registry of plug-ins.

A plug-in is one file: a ``Proposer`` subclass and ``register_proposer(name, factory, help)``; the ``draft_source``
value then validates everywhere (``SamplingParams``, the CLI's ``--draft-source``, the HTTP APIs), and the verified
decoder makes its proposer at the first row that asks for it (``tests/engine/test_toy_proposer.py`` holds one).
"""

from __future__ import annotations

from collections.abc import Callable

from celeris.engine.proposers.base import DraftAsk, Drafts, Proposer, one_hot
from celeris.engine.proposers.dflash import DFlashDrafts
from celeris.engine.proposers.lookup import PromptLookup
from celeris.engine.proposers.lookup_first import LookupFirst
from celeris.engine.proposers.slots import MaskSlots
from celeris.sampling.rules import DRAFT_SOURCES, DraftSource

__all__ = ["BUILTIN_PROPOSERS", "DraftAsk", "Drafts", "Proposer", "make_proposer", "one_hot", "register_proposer",
           "unregister_proposer"]

# the built-in draft sources' proposers (their names, help and checks are declared with the settings:
# ``celeris.sampling.rules.DRAFT_SOURCES`` and ``celeris.sampling.verified.check_draft_source``)
BUILTIN_PROPOSERS: dict[str, type[Proposer]] = {
    p.name: p for p in (LookupFirst, MaskSlots, PromptLookup, DFlashDrafts)}


def register_proposer(name: str, factory: Callable[[object], Proposer], help: str,  # noqa: A002 - the CLI's word
                      check: Callable[..., None] | None = None) -> None:
    """Add ``draft_source`` value ``name``, drafted by ``factory(decoder)`` (a ``Proposer``); ``check(params, drafter,
    slots)`` refuses, raising ValueError whose message starts with the parameter, settings it cannot draft for
    (None: every causal model and setting).

    Raises:
        ValueError: ``name`` is taken.
    """
    if name in DRAFT_SOURCES:
        raise ValueError(f"draft_source '{name}' is already registered")
    DRAFT_SOURCES[name] = DraftSource(help, check, factory)


def unregister_proposer(name: str) -> None:
    """Remove a plug-in added by ``register_proposer`` (tests); the built-ins stay."""
    if name not in BUILTIN_PROPOSERS:
        DRAFT_SOURCES.pop(name, None)


def make_proposer(name: str, decoder: object) -> Proposer:
    """The proposer of ``draft_source`` ``name`` for ``decoder`` (a plug-in's factory, else the built-in's class).

    Raises:
        KeyError: ``name`` is no draft source (``SamplingParams`` refuses such a value first).
    """
    factory = DRAFT_SOURCES[name].proposer or BUILTIN_PROPOSERS[name]
    return factory(decoder)
