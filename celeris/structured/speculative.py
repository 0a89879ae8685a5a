"""Verified (self-speculative) decoding under a grammar: drafts checked against the grammar-masked next-token head.

``celeris.sampling.verified`` checks a row's drafts d_1 .. d_m with the next-token logits at its pending token and
at each draft. Under a grammar (``Constraint``) the target at each position is the next-token distribution with
the tokens the grammar rejects removed, exactly what constrained next-token decoding samples from (the mask of
``Constraint.allowed``, then the budget rule ``Constraint.settle``):

- position a = 0, 1, ...: the target token t_a is the masked argmax (temperature 0) or, at temperature > 0, draft
  d_a kept by speculative sampling against the masked, renormalised distribution p' (Leviathan et al.,
  arXiv:2211.17192, Sec. 2.3: keep with probability min(1, p'(d) / q(d)), else sample norm(max(0, p' - q))); a
  draft the grammar rejects has p'(d) = 0 and is never kept;
- t_a is settled by the budget rule and consumed by the matcher; the walk goes on while the committed token
  equals the draft, and ends at the first correction (or the bonus token after the last draft).

The matcher only ever consumes committed tokens, so nothing needs rolling back. At temperature 0 the committed
tokens are, position by position, the ones constrained next-token decoding commits (the same mask, argmax and
budget rule, called in the same order). Drafts are shaped by the grammar too, which changes the speed, never the
tokens: prompt-lookup drafts are cut to the prefix the grammar accepts (``LLMatcher.validate_tokens``), mask-slot
drafts are drawn from the slots' logits masked by a copy of the matcher advanced over the earlier drafts (vLLM's
structured output with speculative decoding does the same with xgrammar's matcher).
"""

from __future__ import annotations

import torch

from celeris.params import SamplingParams
from celeris.sampling.select import NEG_INF
from celeris.structured.grammar import Constraint, _bits


def _masked(constraint: Constraint, logits: torch.Tensor, remaining: int) -> torch.Tensor:
    """(V,) float logits with the tokens the grammar rejects (``Constraint.allowed``) set to -inf."""
    allowed = constraint.allowed(logits.shape[-1], remaining).to(logits.device)  # (V,) bool
    return logits.masked_fill(~allowed, NEG_INF)


def _sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from ``probs`` (V,) float64 (not necessarily normalised) by inverse transform sampling: a uniform
    draw placed on the cumulative sum. Same distribution as ``torch.multinomial``, about 6x faster on CPU for one
    draw over a 4,096-token vocabulary; a token of probability 0 is never drawn (``right=True``)."""
    cdf = probs.cumsum(0)  # (V,)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[0] - 1)


def greedy_token(constraint: Constraint, logits: torch.Tensor, remaining: int) -> int:
    """The grammar-masked argmax of ``logits`` (V,) with ``remaining`` answer positions left (this one included),
    before the budget rule. The unmasked argmax is checked first (one ``validate_tokens`` call): when the grammar
    accepts it, it is also the masked argmax (ties resolve to the lowest id in both), and no mask is computed."""
    if not constraint.is_forced(remaining):
        top = int(logits.argmax())
        if constraint.accepts(top):
            return top
    return int(_masked(constraint, logits, remaining).argmax())


def verify_under_grammar(constraint: Constraint, p_logits: torch.Tensor, drafts: list[int], q_probs: list,
                         params: SamplingParams, generator: torch.Generator, remaining: int) -> tuple[int, list[int]]:
    """Check one row's drafts against the grammar-masked next-token head and commit (module docstring).

    Args:
        constraint: the row's grammar state, advanced here by every committed token.
        p_logits: (m + 1, V) float32 next-token logits at the pending token and at d_1 .. d_m (banned ids -inf).
        drafts: d_1 .. d_m; q_probs: their (V,) draft distributions (temperature > 0 only).
        params: temperature and top_p are read. generator: the row's CPU generator.
        remaining: answer positions left (the first committed token included); nothing is committed past them.

    Returns:
        (number of drafts accepted, the committed tokens: the accepted drafts and one token of the head's, fewer
        where the grammar ended or the budget ran out).
    """
    from celeris.sampling.verified import _probs

    new: list[int] = []
    for a in range(len(drafts) + 1):
        left = remaining - a
        if left <= 0 or constraint.stopped:
            break
        draft = drafts[a] if a < len(drafts) else None
        if params.temperature == 0:
            token = greedy_token(constraint, p_logits[a], left)
            kept = token == draft
        else:
            p = _probs(_masked(constraint, p_logits[a], left)[None], params.temperature, params.top_p)[0].cpu()
            kept = False
            if draft is not None:
                q = q_probs[a]
                u = float(torch.rand((), generator=generator, dtype=torch.float64))
                kept = u * float(q[draft]) < float(p[draft])  # accept with probability min(1, p'/q)
            if kept:
                token = draft
            elif draft is not None:
                residual = (p - q).clamp(min=0)
                residual = residual / residual.sum() if float(residual.sum()) > 0 else p
                token = _sample(residual, generator)
            else:
                token = _sample(p, generator)
        settled = constraint.settle(token, left)
        constraint.consume(settled)
        new.append(settled)
        if not kept or settled != token:
            return a, new
    return len(new), new


def grammar_lookup_drafts(constraint: Constraint, drafts: list[int]) -> list[int]:
    """Prompt-lookup ``drafts`` cut to the prefix the grammar accepts from its current state (end-of-text
    included where it may end). Unbiased at any temperature: a lookup draft's distribution is one-hot, so a draft
    the grammar rejects would be rejected with certainty and replaced by a sample of the masked head, which is
    what the bonus token after the cut prefix is."""
    if constraint.stopped or not drafts:
        return []
    return drafts[: constraint.matcher.validate_tokens([int(t) for t in drafts])]


def grammar_slot_drafts(constraint: Constraint, slot_logits: torch.Tensor, params: SamplingParams,
                        generator: torch.Generator) -> tuple[list[int], list]:
    """Drafts from the k mask slots' logits (k, V) under the grammar: each slot's token is drawn from its logits
    masked by a copy of the matcher advanced over the earlier drafts (argmax at temperature 0, else a sample
    whose masked distribution q' is returned for speculative sampling). Stops early where the grammar ends."""
    from celeris.sampling.verified import _probs

    if constraint.stopped:
        return [], []
    matcher = constraint.matcher.deep_copy()
    n = min(slot_logits.shape[-1], constraint.vocab_size)
    drafts: list[int] = []
    qs: list = []
    for logits in slot_logits:
        if matcher.is_stopped() or matcher.is_error():
            break
        top = int(logits.argmax())
        if params.temperature == 0 and top < n and matcher.validate_tokens([top]) == 1:
            token = top  # the grammar accepts the slot's argmax: it is the masked argmax too
        else:
            allowed = torch.zeros(logits.shape[-1], dtype=torch.bool)
            allowed[:n] = torch.from_numpy(_bits(matcher)[:n])
            if not bool(allowed.any()):
                break
            masked = logits.masked_fill(~allowed.to(logits.device), NEG_INF)  # (V,)
            if params.temperature == 0:
                token = int(masked.argmax())
            else:
                qs.append(_probs(masked[None], params.temperature, params.top_p)[0].cpu())  # (V,) q'
                token = _sample(qs[-1], generator)
        if not matcher.consume_token(token):
            break
        drafts.append(token)
    return drafts, qs[: len(drafts)]
