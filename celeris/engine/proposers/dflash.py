"""A DFlash drafter beside the target (``draft_source`` ``dflash``; ``celeris.sampling.drafter``): block-diffusion
drafts from the target's hidden states of the columns each pass accepted (arXiv:2602.06036)."""

from __future__ import annotations

from dataclasses import replace

from celeris.engine.draft_rows import DraftRow
from celeris.engine.proposers.base import DraftAsk, Drafts, Proposer, one_hot, penalized
from celeris.models import fast_ops
from celeris.sampling.drafter import over_target_vocab
from celeris.sampling.verified import grammar_slot_drafts


class DFlashDrafts(Proposer):
    """One drafter call per row (``DFlashProposer.propose_draft_vocab``): its argmax at every temperature (checked against a
    copy of the grammar when the row has one), the leading drafts the drafter is sure of under a
    ``draft_confidence_threshold``, one-hot distributions when sampling; its passes compute no mask slots."""

    name = "dflash"

    def propose(self, asks: list[DraftAsk]) -> list[Drafts]:
        return [self.drafts(a) for a in asks]

    def drafts(self, ask: DraftAsk) -> Drafts:
        """One row's drafter drafts after its last token. The drafter's keys/values live in the row's drafter
        layers of the KV store (bound before each call: rows move), unless the store holds another drafter's (it
        was allocated before this one was attached): then in the row's ``DraftState`` alone."""
        decoder, row = self.decoder, ask.row
        drafter = decoder.proposer
        if decoder.segment.store.drafter is drafter.drafter:
            row.draft_state.cache.bind([k[ask.index : ask.index + 1] for k in decoder.segment.draft_keys],
                                       [v[ask.index : ask.index + 1] for v in decoder.segment.draft_values])
        logits, ids = drafter.propose_draft_vocab(row.draft_state, ask.last_token, ask.pending, row.k)
        logits = penalized(row, logits, ids)  # (k, V_draft) or (k, V)
        if row.constraint is not None:  # the grammar's mask is over the target's vocabulary
            full = over_target_vocab(logits, ids, ask.vocab)
            tokens, _ = grammar_slot_drafts(row.constraint, full, replace(row.params, temperature=0.0), row.generator)
            tokens = drafter.confident(full, tokens)
        else:  # the argmax over the draft vocabulary's columns (ascending ids: ties resolve as over the whole)
            columns = fast_ops.argmax(logits)
            tokens = (columns if ids is None else ids[columns]).tolist()
            tokens = drafter.confident(logits, tokens, columns.tolist())
        return Drafts(tokens, one_hot(tokens, ask.vocab, row.params.temperature), 0, from_drafter=True)

    def observe(self, row: DraftRow, accepted: int) -> None:
        """Fold what the row's last drafter call brought into its gain (``draft_min_gain``)."""
        if row.draft_state is not None and row.draft_state.from_drafter:
            self.decoder.proposer.record(row.draft_state, accepted)
            row.draft_state.from_drafter = False
