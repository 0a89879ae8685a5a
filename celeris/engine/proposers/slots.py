"""A hybrid model's own mask slots (``draft_source`` ``slots``): the target's pass also fills k mask slots after
the row's drafts (``celeris.sampling.verified``'s layout), and when every draft held they become the next drafts."""

from __future__ import annotations

from celeris.engine.proposers.base import DraftAsk, Drafts, Proposer, penalized
from celeris.sampling.verified import grammar_slot_drafts, slot_drafts


class MaskSlots(Proposer):
    """Drafts from the pass's mask slots (argmax at temperature 0, else samples and their q; under a grammar the
    slots' logits masked by a copy of the matcher); after a rejection none, and the next pass drafts afresh."""

    name = "slots"

    def first_slots(self, k: int) -> int:
        return min(k, self.decoder.slots)

    def propose(self, asks: list[DraftAsk]) -> list[Drafts]:
        return [self.drafts(a) for a in asks]

    def drafts(self, ask: DraftAsk) -> Drafts:
        """One row's drafts from its slots (none when they were not conditioned on the accepted prefix)."""
        row, slots = ask.row, self.first_slots(ask.row.k)
        if ask.slot_logits is None:
            return Drafts([], [], slots)
        logits = penalized(row, ask.slot_logits)
        if row.constraint is not None:
            return Drafts(*grammar_slot_drafts(row.constraint, logits, row.params, row.generator), slots)
        return Drafts(*slot_drafts(logits, row.params, row.generator), slots)
