"""What a draft proposer of verified decoding is given and what the decoder asks of it (vLLM's ``v1/spec_decode``
proposers behind one base class).

After each verified pass, every row that goes on asks for the drafts its next pass checks (``DraftAsk``); the decoder
(``celeris.engine.verified.VerifiedDecoder``) groups the asks by the row's ``draft_source`` and hands each group to
that source's proposer in one call (``Proposer.propose``), which answers one ``Drafts`` per ask. After the next pass
has verified them, the decoder tells the row's proposer how many were accepted (``Proposer.observe``). A proposer
changes the speed, never the tokens: the target checks every draft (``celeris.sampling.verified``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from celeris.engine.draft_rows import DraftRow
from celeris.sampling.step import History, apply_penalties


@dataclass(slots=True)
class DraftAsk:
    """One row asking for its next pass's drafts, after its pass was verified and its tokens committed.

    Attributes:
        index: the row's place in the decoder this step (its row of the KV store; rows move only between steps).
        row: the row (``DraftRow``: its prompt, answer so far, settings, generator, grammar, drafter state).
        last_token: its last committed token.
        pending: the column of that token (the next pass computes its keys/values and its next-token logits).
        vocab: the target's vocabulary size V (the width of a draft distribution).
        slot_logits: (num_slots, V) float32 logits of the pass's mask slots when they were conditioned on the
            accepted prefix (every draft held), else None.
    """

    index: int
    row: DraftRow
    last_token: int
    pending: int
    vocab: int
    slot_logits: torch.Tensor | None = None


@dataclass(slots=True)
class Drafts:
    """A proposer's answer to one ask.

    Attributes:
        tokens: the drafts, at most the row's ``k`` (may be empty: the next pass decodes next-token).
        probs: per draft the (V,) float64 distribution q it was drawn from ([] at temperature 0; one-hot for a
            deterministic draft), for speculative sampling.
        slots: mask slots the next pass computes after the drafts (a hybrid model's own draft block; 0 for
            proposers that need none).
        from_drafter: the drafts came from a DFlash drafter call (its gain is then recorded: ``observe``).
    """

    tokens: list[int]
    probs: list
    slots: int = 0
    from_drafter: bool = False


def one_hot(tokens: list[int], vocab: int, temperature: float) -> list:
    """The draft distributions of deterministic drafts: [] at temperature 0 (greedy verification reads none), else
    one (V,) float64 one-hot per token."""
    return [] if temperature == 0 else [torch.nn.functional.one_hot(torch.tensor(t), vocab).double() for t in tokens]


def penalized(row: DraftRow, logits: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """A row's draft logits (k, V) with its penalties over its tokens so far, or (k, V_draft) with those of the
    target ids ``ids`` of their columns (the same values at those ids); as is without a penalty. Drafts are only
    guesses, so the drafts of one block do not penalize each other; verification does (``penalize_along``)."""
    if row.history is None:
        return logits
    history = row.history if ids is None else History(
        None if row.history.seen is None else row.history.seen[:, ids],
        None if row.history.counts is None else row.history.counts[:, ids])
    return apply_penalties(logits[None], row.penalty_settings, history)[0]


class Proposer:
    """One ``draft_source``'s proposer, made by the decoder at the first row that asks for it.

    Args:
        decoder: the verified decoder it drafts for: its ``proposer`` (the DFlash drafter beside the target, or
            None), ``slots`` (mask slots the target drafts), ``rows`` (the rows running) and ``segment`` (their KV
            rows).
    """

    name: ClassVar[str] = ""

    def __init__(self, decoder: object) -> None:
        self.decoder = decoder

    def first_slots(self, k: int) -> int:
        """Mask slots a new row's first pass (its prefill) computes for a row checking ``k`` drafts; none here."""
        return 0

    def propose(self, asks: list[DraftAsk]) -> list[Drafts]:
        """The drafts of every ask, in order (one call per step for all rows of this source)."""
        raise NotImplementedError

    def observe(self, row: DraftRow, accepted: int) -> None:
        """``row``'s last pass accepted ``accepted`` of the drafts this proposer gave it; nothing to learn here."""
