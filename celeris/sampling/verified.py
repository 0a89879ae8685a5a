"""Verified (self-speculative) decoding for hybrid models: block-diffusion drafts checked by the next-token head.

A hybrid model (``celeris train --objective hybrid``, config ``draft_block_size`` = k > 0) is a causal model
that has also learnt to fill a fully masked block of k slots placed after its committed tokens, each slot
attending to the committed tokens and bidirectionally to the other slots (BD3-LM's block layout,
arXiv:2503.09573). Scoring is shifted: the hidden state at column c scores the token at c + 1.

One forward pass per step computes, per row, the columns

    [pending | d_1 .. d_m | M_1 .. M_k]

- ``pending``: the last committed token, whose keys/values are not cached yet (causal);
- ``d_1 .. d_m``: the previous pass's drafts, fed as ordinary causal tokens (m <= k, 0 after a rejection);
- ``M_1 .. M_k``: k mask slots, a fully masked block: the slot at column s + i drafts the token at s + i + 1.

The next-token logits at ``pending`` and at each draft verify the drafts left to right: the longest prefix
equal to what next-token decoding would produce is accepted, plus one token from the next-token head (the
correction, or the bonus token after a fully accepted draft). When every draft was accepted the mask slots
were conditioned on the right prefix and become the next pass's drafts; otherwise the next pass drafts
afresh. This is TiDAR's draft-and-verify in one pass (arXiv:2511.08923) with Set Block Decoding's layout
(arXiv:2509.04185). Keys/values of rejected drafts and of mask slots stay in the cache but are never
attended (every query sees only columns up to its own, or its own block), and are overwritten later: that
is the rollback, and rows of a batch advance by different lengths (ragged).

At temperature 0 the answer is exactly the model's greedy next-token answer. At temperature > 0 drafts are
sampled from the slots' distributions q and accepted by speculative sampling (Leviathan et al.,
arXiv:2211.17192, Sec. 2.3; Chen et al., arXiv:2302.01318, Alg. 2): draft x is kept with probability
min(1, p(x) / q(x)), a rejection samples from norm(max(0, p - q)), so every committed token is distributed
as the next-token head p (after temperature and top-p) says.

Drafts may also come from prompt lookup (``SamplingParams.draft_source``: the tokens that followed the last
earlier occurrence of the context's last 3 or 2 tokens; Saxena 2023, vLLM's ``ngram`` speculator), which needs
no mask slots and so also runs on a plain causal model; ``lookup_first`` (the default) uses lookup where the
context repeats and the slots elsewhere, and a pass whose drafts came from lookup computes no slots. The drafts'
source changes the speed, never the tokens.

With a DFlash drafter beside the target (``--speculative-config``; ``celeris.sampling.drafter``), draft source
``dflash`` (and ``lookup_first``'s fallback) takes the drafts from the drafter, which reads the target's hidden
states of the columns each pass accepted; a pass then computes no mask slots (the target needs none), only
``[pending | d_1 .. d_m]``.

Under a grammar (``SamplingParams.grammar``: structured output, tool calls; ``verify_under_grammar``) the target at
each position is the next-token distribution with the tokens the grammar rejects removed, exactly what constrained
next-token decoding samples from (the mask of ``Constraint.allowed``, then the budget rule ``Constraint.settle``):

- position a = 0, 1, ...: the target token t_a is the masked argmax (temperature 0) or, at temperature > 0, draft
  d_a kept by speculative sampling against the masked, renormalised distribution p' (``accept_draft``, the same
  accept/residual step as without a grammar); a draft the grammar rejects has p'(d) = 0 and is never kept;
- t_a is settled by the budget rule and consumed by the matcher; the walk goes on while the committed token
  equals the draft, and ends at the first correction (or the bonus token after the last draft).

The matcher only ever consumes committed tokens, so nothing needs rolling back. At temperature 0 the committed
tokens are, position by position, the ones constrained next-token decoding commits (the same mask, argmax and
budget rule, called in the same order), so the answer is exactly constrained next-token decoding's. Drafts are
shaped by the grammar too, which changes the speed, never the tokens: prompt-lookup drafts are cut to the prefix the
grammar accepts (``grammar_lookup_drafts``: ``LLMatcher.validate_tokens``), mask-slot drafts are drawn from the
slots' logits masked by a copy of the matcher advanced over the earlier drafts (``grammar_slot_drafts``; vLLM's
structured output with speculative decoding does the same with xgrammar's matcher).

The engine's decoder (``celeris.engine.verified``: ``VerifiedDecoder``, ``DraftRow``, ``generate_verified``) runs
the passes and owns the KV memory; this module holds the rules it shares: the checks, the drafts (lookup, slots,
under a grammar) and the verification (``accept_draft``, ``verify_drafts``, ``verify_under_grammar``). It calls no
model and holds no KV memory.
"""


from __future__ import annotations

import torch

from celeris.models import fast_ops
from celeris.sampling.drafter import DFlashProposer, check_num_drafts, proposer_of
from celeris.sampling.dry import DrySettings, apply_dry, dry_penalties
from celeris.sampling.params import SamplingParams
from celeris.sampling.rules import DRAFT_SOURCES
from celeris.sampling.select import NEG_INF, probs
from celeris.sampling.step import History, RowSettings, apply_penalties
from celeris.structured.grammar import Constraint, _bits

LOOKUP_DRAFTS = 4  # drafts per pass for a causal model without mask slots (prompt lookup only)
MAX_DRAFTS = 16  # the most drafts one pass may check (``num_speculative_tokens``' upper bound)


def draft_length(model: torch.nn.Module) -> int:
    """k, the number of mask slots a hybrid model drafts (config ``draft_block_size``); 0 for other models."""
    config = model.config
    return int(getattr(config, "draft_block_size", 0) or 0) if getattr(config, "is_causal", False) else 0


def check_verified_support(model: torch.nn.Module, params: SamplingParams, has_suffix: bool = False) -> None:
    """Raise ValueError when verified decoding cannot run ``params`` on ``model``.

    Needs a causal model trained to draft (``draft_length`` > 0) or a DFlash drafter beside it
    (``celeris.sampling.drafter.attach``), except for prompt lookup; settings it does not implement
    (``cfg_scale``, infilling) are refused naming the setting.
    """
    if not getattr(model.config, "is_causal", False) or not getattr(model, "supports_kv_cache", False):
        raise ValueError("decoding 'verified' needs a causal model with a KV cache (a hybrid model for mask-slot "
                         "drafts, or any causal model with draft_source 'lookup')")
    proposer = proposer_of(model)
    check_draft_source(params, proposer, mask_slots(model, proposer))
    if params.cfg_scale:
        raise ValueError("cfg_scale is not supported with decoding 'verified'")
    if has_suffix:
        raise ValueError("infilling (a suffix) is not supported with decoding 'verified'")


def mask_slots(model: torch.nn.Module, proposer: DFlashProposer | None) -> int:
    """Mask slots a pass of verified decoding computes for ``model``: its ``draft_length``, or none beside a DFlash
    drafter (which drafts instead; ``VerifiedDecoder.slots``)."""
    return 0 if proposer is not None else draft_length(model)


def check_draft_source(params: SamplingParams, proposer: DFlashProposer | None, slots: int) -> None:
    """Raise ValueError (first word: the parameter) when ``params.draft_source`` and ``num_speculative_tokens``
    cannot draft with ``proposer`` (a DFlash drafter, or None) and ``slots`` mask slots (``mask_slots``): the one
    check of the draft settings, run at admission (``check_verified_support``) and by ``VerifiedDecoder.add``; a
    plug-in source (``celeris.sampling.rules.DraftSource``) is checked by its own ``check``."""
    source, k = params.draft_source, params.num_speculative_tokens
    plugin = DRAFT_SOURCES[source]
    if plugin.proposer is not None:  # a plug-in's source (``celeris.engine.proposers.register_proposer``)
        if plugin.check is not None:
            plugin.check(params, proposer, slots)
        return
    if source == "dflash" and proposer is None:
        raise ValueError("draft_source 'dflash' needs a DFlash drafter beside the model (--speculative-config "
                         "'{\"method\": \"dflash\", \"model\": PATH}')")
    if source == "slots" and proposer is not None:
        raise ValueError("draft_source 'slots' needs a hybrid model; this target drafts with its DFlash drafter "
                         "(draft_source 'dflash' or 'lookup_first')")
    if proposer is None and slots < 1 and source != "lookup":
        raise ValueError(f"draft_source '{source}' needs a hybrid model (a causal model with "
                         "draft_block_size > 0, trained by `celeris train --objective hybrid`); use draft_source "
                         "'lookup' for this one")
    if proposer is not None and source != "lookup" and k:
        check_num_drafts(k, proposer.block_size, proposer.name)
    if k and source == "slots" and k > slots:
        raise ValueError(f"num_speculative_tokens {k} exceeds the {slots} mask slots this model was "
                         "trained to draft (draft_source 'slots'); use at most that, or draft_source 'lookup'")


def accept_draft(p: torch.Tensor, q: torch.Tensor, draft: int, generator: torch.Generator) -> torch.Tensor | None:
    """Speculative sampling's test of one draft (Leviathan et al., arXiv:2211.17192, Sec. 2.3; Chen et al.,
    arXiv:2302.01318, Alg. 2): keep ``draft`` with probability min(1, p(d) / q(d)) (one U(0, 1) draw from
    ``generator``); None when it is kept, else the residual norm(max(0, p - q)) (``p`` where that is all zero)
    to draw the correction from. The one accept/residual step of verified decoding, with and without a grammar.

    Args:
        p: (V,) float64 target probabilities (after temperature and top-p; under a grammar, masked and renormalised).
        q: (V,) float64 probabilities the draft was drawn from (one-hot for prompt-lookup and DFlash drafts).
    """
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    if u * float(q[draft]) < float(p[draft]):  # accept with probability min(1, p/q)
        return None
    residual = (p - q).clamp(min=0)
    return residual / residual.sum() if float(residual.sum()) > 0 else p


def greedy_accept(drafts: list[int], greedy: list[int]) -> tuple[int, int]:
    """Greedy verification: (the drafts that equal the target's argmax ``greedy`` (m + 1 ids) before the first that
    does not, the argmax after them)."""
    a = 0
    while a < len(drafts) and drafts[a] == greedy[a]:
        a += 1
    return a, greedy[a]


def verify_drafts(p_logits: torch.Tensor, drafts: list[int], q_probs: list[torch.Tensor], params: SamplingParams,
            gen: torch.Generator) -> tuple[int, int]:
    """Check one row's drafts: (number accepted, the next-token head's token after them).

    ``p_logits`` (m + 1, V): next-token logits at pending, d_1 .. d_m; ``q_probs``: the draft distributions
    (temperature > 0 only). Random draws come from the row's own CPU generator.
    """
    if params.temperature == 0:
        return greedy_accept(drafts, fast_ops.argmax(p_logits).tolist())
    p = probs(p_logits, params.temperature, params.top_p).cpu()  # (m + 1, V)
    for a, (d, q) in enumerate(zip(drafts, q_probs, strict=True)):
        residual = accept_draft(p[a], q, d, gen)
        if residual is not None:
            return a, int(torch.multinomial(residual, 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen))


def draft_counts(drafts: list[int], positions: int) -> list[list[tuple[int, int]]]:
    """Per verify position p < ``positions`` (the logits after d_p; p = 0: after the pending token), the (token, n)
    pairs its history counts beyond the row's own: each distinct token of d_1 .. d_p with its count there (none at
    p = 0). What ``penalize_along`` and ``greedy_along`` add to the row's history."""
    return [[(t, drafts[:p].count(t)) for t in set(drafts[:p])] for p in range(positions)]


def penalize_along(logits: torch.Tensor, history: History | None, drafts: list[int], settings: RowSettings | None,
                   context: list[int] | None = None, dry: DrySettings | None = None) -> torch.Tensor:
    """The penalties (``apply_penalties``: CTRL's repetition penalty, OpenAI's frequency and presence penalties) at
    one row's m + 1 verify positions, each with its own history: position j (the logits after d_j; j = 0: after the
    pending token) reads the row's tokens so far plus the drafts d_1 .. d_j, the history next-token decoding
    penalizes with once they are committed; a position is only used where every draft before it was accepted, so
    the verified answer is exactly the penalized next-token answer (temperature 0), or distributed as it
    (speculative sampling).

    With ``dry`` (the row's DRY settings, ``celeris.sampling.dry``), DRY's penalties follow at each position,
    after ``context`` (the row's prompt and answer so far) and the drafts before it, as ``apply_penalties`` orders
    them.

    Args:
        logits: (m + 1, V) float next-token logits. history: the row's, (1, V) tensors (``History.of``), or None
            (DRY alone). drafts: d_1 .. d_m. settings: the row's ``RowSettings`` (None with no history).

    Returns:
        (m + 1, V) penalized logits (a new tensor).
    """
    out = _penalize_drafts(logits, history, drafts, settings) if history is not None else logits.clone()
    if dry is not None:
        found = [dry_penalties(context + drafts[:p], dry) for p in range(logits.shape[0])]
        out = apply_dry(out[None], [found])[0]
    return out


def _penalize_drafts(logits: torch.Tensor, history: History, drafts: list[int], settings: RowSettings) -> torch.Tensor:
    """``penalize_along`` without DRY: the repetition, frequency and presence penalties at each position."""
    out = apply_penalties(logits[None], settings, history)[0]  # every position under the row's tokens so far
    # then the entries the drafts change: position p's token t, seen and counted once more per d_j = t, j <= p;
    # the same elementwise float operations on those entries alone give the same values as on whole rows
    entries = [(p, t, n) for p, extra in enumerate(draft_counts(drafts, logits.shape[0])) for t, n in extra]
    if not entries:
        return out
    rows, tokens, extra = (torch.tensor(column, device=logits.device) for column in zip(*entries, strict=True))
    seen = None if history.seen is None else torch.ones((1, len(entries)), dtype=torch.bool, device=logits.device)
    counts = None if history.counts is None else (history.counts[0, tokens] + extra.to(history.counts.dtype))[None]
    out[rows, tokens] = apply_penalties(logits[rows, tokens][None, None], settings, History(seen, counts))[0, 0]
    return out


def greedy_along(logits: torch.Tensor, history: History, drafts: list[int],
                 settings: RowSettings) -> list[int] | None:
    """The argmax of ``penalize_along(logits, history, drafts, settings)`` at each of the m + 1 verify positions,
    in one kernel pass over the positions (``fast_ops.penalized_argmax``: the row's counts once, the drafts before
    each position as extra counts of their entries; the same float operations, so the same ids), without the
    (m + 1, V) penalized copy; None where the kernel does not take it (CTRL's repetition penalty, no kernel, a
    history of positions): the caller then penalizes and takes the argmax. (m + 1, V) float32 logits, banned ids
    already at -inf."""
    if settings.any_penalty or history.counts is None or history.counts.dim() != 2:
        return None
    frequency = settings.frequency_penalty if settings.any_frequency_penalty else None
    presence = settings.presence_penalty if settings.any_presence_penalty else None
    done = fast_ops.penalized_argmax(logits, history.counts, frequency, presence, [],
                                     draft_counts(drafts, logits.shape[0]))
    return None if done is None else done[0].tolist()


def slot_drafts(slot_logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[list[int], list]:
    """Drafts from the k mask slots' logits (k, V): argmax at temperature 0, else samples and their q."""
    if params.temperature == 0:
        return fast_ops.argmax(slot_logits).tolist(), []
    q = probs(slot_logits, params.temperature, params.top_p).cpu()  # (k, V)
    return torch.multinomial(q, 1, generator=gen)[:, 0].tolist(), list(q)


def lookup_drafts(tokens: list[int], k: int, n_max: int = 3, n_min: int = 2) -> list[int]:
    """Prompt-lookup drafts (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` speculator): the up to
    k tokens that followed the most recent earlier occurrence of the last n tokens of ``tokens``, trying
    n = ``n_max`` down to ``n_min``; [] when none occurs. Costs no forward pass."""
    length = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if length <= n:
            continue
        tail = tokens[-n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


# ---------------------------------------------------------------- under a grammar (module docstring)


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
        top = int(fast_ops.argmax(logits))
        if constraint.accepts(top):
            return top
    return int(_masked(constraint, logits, remaining).argmax())


def verify_under_grammar(constraint: Constraint, p_logits: torch.Tensor, drafts: list[int], q_probs: list,
                         params: SamplingParams, generator: torch.Generator, remaining: int) -> tuple[int, list[int]]:
    """Check one row's drafts against the grammar-masked next-token head and commit (module docstring, "Under a
    grammar").

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
            p = probs(_masked(constraint, p_logits[a], left)[None], params.temperature, params.top_p)[0].cpu()
            residual = p if draft is None else accept_draft(p, q_probs[a], draft, generator)  # p' against q
            kept = residual is None
            token = draft if kept else _sample(residual, generator)
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
    if constraint.stopped:
        return [], []
    matcher = constraint.matcher.deep_copy()
    n = min(slot_logits.shape[-1], constraint.vocab_size)
    drafts: list[int] = []
    qs: list = []
    for logits in slot_logits:
        if matcher.is_stopped() or matcher.is_error():
            break
        top = int(fast_ops.argmax(logits))
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
                qs.append(probs(masked[None], params.temperature, params.top_p)[0].cpu())  # (V,) q'
                token = _sample(qs[-1], generator)
        if not matcher.consume_token(token):
            break
        drafts.append(token)
    return drafts, qs[: len(drafts)]
