"""The default ``draft_source``, ``lookup_first``: prompt lookup where the context repeats, else the DFlash drafter
(beside the target) or the hybrid model's mask slots."""

from __future__ import annotations

from celeris.engine.draft_rows import DraftRow
from celeris.engine.proposers.base import DraftAsk, Drafts, Proposer
from celeris.engine.proposers.dflash import DFlashDrafts
from celeris.engine.proposers.lookup import PromptLookup
from celeris.engine.proposers.slots import MaskSlots


class LookupFirst(Proposer):
    """Per row: prompt lookup's drafts when there are any (skipped with ``lookup_disable_by_batch_size`` rows or
    more), else the drafter's (skipped with ``disable_by_batch_size`` rows or more, or while the row's gain is
    below ``draft_min_gain``: ``DFlashProposer.worth_calling``), else the mask slots'; a pass whose drafts came
    from lookup computes no slots."""

    name = "lookup_first"

    def __init__(self, decoder: object) -> None:
        super().__init__(decoder)
        self.slots, self.drafter = MaskSlots(decoder), DFlashDrafts(decoder)

    def first_slots(self, k: int) -> int:
        return self.slots.first_slots(k)

    def propose(self, asks: list[DraftAsk]) -> list[Drafts]:
        drafter, running = self.decoder.proposer, len(self.decoder.rows)
        look = drafter is None or drafter.lookup_enabled(running)
        out = []
        for ask in asks:
            if tokens := PromptLookup.tokens(ask.row, look):
                out.append(PromptLookup.drafts(ask, tokens))
            elif drafter is not None and drafter.enabled(running) and drafter.worth_calling(ask.row.draft_state):
                out.append(self.drafter.drafts(ask))
            else:
                out.append(self.slots.drafts(ask))
        return out

    def observe(self, row: DraftRow, accepted: int) -> None:
        self.drafter.observe(row, accepted)
