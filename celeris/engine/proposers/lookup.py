"""Prompt lookup (``draft_source`` ``lookup``): the tokens that followed the last earlier occurrence of the
context's last 3 or 2 tokens (Saxena 2023; vLLM's ``ngram`` speculator), on any causal model."""

from __future__ import annotations

from celeris.engine.draft_rows import DraftRow
from celeris.engine.proposers.base import DraftAsk, Drafts, Proposer, one_hot
from celeris.sampling.verified import grammar_lookup_drafts, lookup_drafts


class PromptLookup(Proposer):
    """Drafts from the row's own prompt and answer (``lookup_drafts``), cut to what its grammar accepts; its passes
    compute no mask slots."""

    name = "lookup"

    def propose(self, asks: list[DraftAsk]) -> list[Drafts]:
        return [self.drafts(a, self.tokens(a.row)) for a in asks]

    @staticmethod
    def tokens(row: DraftRow, look: bool = True) -> list[int]:
        """Up to ``row.k`` lookup drafts ([] when ``look`` is False or nothing repeats), cut by its grammar."""
        drafts = lookup_drafts(row.prompt_ids + row.answer, row.k) if look else []
        return drafts if row.constraint is None else grammar_lookup_drafts(row.constraint, drafts)

    @staticmethod
    def drafts(ask: DraftAsk, tokens: list[int]) -> Drafts:
        """``tokens`` as one-hot drafts with no mask slots after them."""
        return Drafts(tokens, one_hot(tokens, ask.vocab, ask.row.params.temperature), 0)
