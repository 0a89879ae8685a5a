"""Decoding rules as registered objects: the commit rules (how many masked positions a denoising step fills)
and the remasking confidences (which ones), each declaring the ``SamplingParams`` fields it reads.

The reference sampler (``celeris.reference.masked``) and the engine share ``denoise_step``
(``celeris.sampling.step``), which looks rules up here and never names one. ``SamplingParams`` takes its
``decoding`` and ``remasking`` choices from these dicts and refuses a setting the chosen rule does not read
(``celeris.sampling.params.rule_settings``), so a new rule that reuses existing settings is one function and one
``celeris.sampling.params.register_commit_rule`` call; one that needs a new setting also declares that field in
``SamplingParams``. This module holds the tables only: registering checks a rule's params against the fields of
``SamplingParams``, so it lives in ``celeris.sampling.params``, which reads these tables (never the other way round).
The registries are read at call time (validation, CLI choices, HTTP), so a rule registered after import works
everywhere.

Every commit function has the signature ``fn(conf, *, num_tokens, <its params>, <its needs>) -> chosen``:
``conf`` (B, L) float64 confidences, -inf where a position is not masked; ``num_tokens`` (B,) int64 the linear
schedule's count for this step; each declared param as a (B, 1) float64 tensor (one value per row); each
declared need as a (B, L) tensor (``NEEDS``). It returns (B, L) bool, the positions to commit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from celeris.sampling.select import (
    NEG_INF,
    low_confidence,
    margin_confidence,
    neg_entropy_confidence,
    random_confidence,
    rank_desc,
)


def commit_fixed(conf: torch.Tensor, num_tokens: torch.Tensor, **_: object) -> torch.Tensor:
    """Commit the ``num_tokens`` (B,) most confident masked positions (LLaDA low-confidence remasking).

    ``conf`` (B, L) is -inf at positions that are not masked. Returns (B, L) bool.
    """
    return (rank_desc(conf) < num_tokens[:, None]) & (conf > NEG_INF)


def _at_least_one(conf: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Add each row's most confident masked position, so every step makes progress."""
    return chosen | ((rank_desc(conf) == 0) & (conf > NEG_INF))


def commit_threshold(conf: torch.Tensor, threshold: float, **_: object) -> torch.Tensor:
    """Fast-dLLM (arXiv:2505.22618, Sec. 3.3): commit every masked position with confidence > threshold,
    and at least the most confident one. Returns (B, L) bool."""
    return _at_least_one(conf, conf > threshold)


def commit_factor(conf: torch.Tensor, factor: float, **_: object) -> torch.Tensor:
    """Fast-dLLM factor rule: with confidences sorted c_1 >= c_2 >= ..., commit the n most
    confident for the largest n with c_j >= 1 - factor / (j + 1) for all j <= n (at least one)."""
    sorted_conf, order = conf.sort(dim=-1, descending=True)  # (B, L)
    j = torch.arange(1, conf.shape[-1] + 1, device=conf.device, dtype=conf.dtype)
    ok = (sorted_conf >= 1 - factor / (j + 1)) & (sorted_conf > NEG_INF)
    prefix = ok.long().cumprod(-1).bool()  # accepted while every earlier one was accepted
    chosen = torch.zeros_like(prefix).scatter(-1, order, prefix)
    return _at_least_one(conf, chosen)


def commit_entropy(conf: torch.Tensor, entropy: torch.Tensor, entropy_bound: float, **_: object) -> torch.Tensor:
    """EB-sampler (arXiv:2505.24857): in confidence order, commit positions while the summed
    entropy (nats) of the committed set stays <= entropy_bound; at least one per step."""
    _, order = conf.sort(dim=-1, descending=True)
    ent_sorted = entropy.gather(-1, order).masked_fill(conf.gather(-1, order) == NEG_INF, float("inf"))
    prefix = ent_sorted.cumsum(-1) <= entropy_bound
    chosen = torch.zeros_like(prefix).scatter(-1, order, prefix)
    return _at_least_one(conf, chosen)


def commit_low_confidence_dynamic(conf: torch.Tensor, num_tokens: torch.Tensor, threshold: float | torch.Tensor,
                                  **_: object) -> torch.Tensor:
    """SDAR's ``low_confidence_dynamic`` (JetAstra/SDAR ``generate.py``; LMDeploy's ``dllm_unmasking_strategy``):
    commit every masked position with confidence > ``threshold`` when there are at least ``num_tokens`` (B,)
    of them (the static count of this step), else fall back to the ``num_tokens`` most confident (not to one
    token). ``conf`` (B, L) is -inf where not masked. Returns (B, L) bool."""
    above = (conf > threshold) & (conf > NEG_INF)
    enough = above.sum(-1, keepdim=True) >= num_tokens[:, None]
    return torch.where(enough, above, commit_fixed(conf, num_tokens))


def commit_sequential(conf: torch.Tensor, num_tokens: torch.Tensor, **_: object) -> torch.Tensor:
    """SDAR's ``sequential`` rule: the ``num_tokens`` (B,) positions from the block's first masked one on, left to
    right (those of them that are masked), whatever their confidence. Returns (B, L) bool."""
    is_masked = conf > NEG_INF  # (B, L)
    cols = torch.arange(conf.shape[-1], device=conf.device)[None]
    first = torch.where(is_masked, cols, conf.shape[-1]).min(-1, keepdim=True).values  # (B, 1)
    return is_masked & (cols >= first) & (cols < first + num_tokens[:, None])


def token_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy -sum_v p_v log p_v (nats) of each position's distribution: (B, L, V) -> (B, L) float64."""
    return -(probs * probs.clamp_min(1e-30).log()).sum(-1).double()


# Inputs a commit rule may ask for besides the confidences, computed from the step's (B, L, V) probabilities.
NEEDS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"entropy": token_entropy}


@dataclass(frozen=True, slots=True)
class CommitRule:
    """One ``decoding`` choice.

    Attributes:
        fn: the commit function (module docstring), or None for a choice with its own sampler (``verified``).
        help: one line for ``--help`` and the docs, with the source.
        params: the ``SamplingParams`` fields it reads (each passed to ``fn`` as a (B, 1) float64 tensor).
        needs: names in ``NEEDS`` passed to ``fn`` as well.
    """

    fn: Callable[..., torch.Tensor] | None
    help: str
    params: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()

    @property
    def denoises(self) -> bool:
        """True for a masked-diffusion commit rule (it reads ``DENOISING_PARAMS``)."""
        return self.fn is not None

    @property
    def reads(self) -> tuple[str, ...]:
        """Every ``SamplingParams`` field a request with this rule reads beyond the common ones."""
        return self.params + (DENOISING_PARAMS if self.denoises else ())


@dataclass(frozen=True, slots=True)
class Confidence:
    """One ``remasking`` choice: ``fn(probs (B, L, V), x0 (B, L), generators, lengths) -> (B, L) float64``
    scores (higher commits first); ``params`` as ``CommitRule.params``."""

    fn: Callable[..., torch.Tensor]
    help: str
    params: tuple[str, ...] = ()


# Settings every masked-diffusion commit rule reads (not the ``verified`` sampler).
DENOISING_PARAMS = ("remasking", "top_k", "min_p")

COMMIT_RULES: dict[str, CommitRule] = {
    "fixed": CommitRule(commit_fixed, "the linear schedule's count per step (LLaDA)"),
    "threshold": CommitRule(commit_threshold, "confidence > --threshold (Fast-dLLM)", params=("threshold",)),
    "factor": CommitRule(commit_factor, "Fast-dLLM's factor rule (--factor)", params=("factor",)),
    "entropy": CommitRule(commit_entropy, "EB-sampler: summed entropy <= --entropy-bound (not --remasking entropy)",
                          params=("entropy_bound",), needs=("entropy",)),
    # SDAR's names (arXiv:2510.06303; JetEngine / LMDeploy ``remasking_strategy``); ``low_confidence_static`` is
    # LLaDA's fixed count of the most confident positions
    "low_confidence_static": CommitRule(commit_fixed, "SDAR's name for fixed: the step's count, most confident first"),
    "low_confidence_dynamic": CommitRule(commit_low_confidence_dynamic, "SDAR: every position above --threshold "
                                         "when at least the step's count are, else that count", params=("threshold",)),
    "sequential": CommitRule(commit_sequential, "SDAR: the step's count, left to right"),
    "verified": CommitRule(None, "hybrid models: drafts checked by the next-token head (celeris.sampling.verified)",
                           params=("draft_source", "num_speculative_tokens")),
}

@dataclass(frozen=True, slots=True)
class DraftSource:
    """One ``draft_source`` value of verified decoding (``SamplingParams.draft_source``).

    Attributes:
        help: one line for the CLI's and the docs' lists.
        check: a plug-in's ``check(params, drafter, slots)``, raising ValueError whose message starts with the
            parameter, for draft settings it cannot serve (the built-ins' rules are
            ``celeris.sampling.verified.check_draft_source``); None: nothing to refuse.
        proposer: a plug-in's proposer factory ``proposer(decoder)`` (``celeris.engine.proposers.register_proposer``);
            None for the built-ins, whose proposers are the engine's own table (``BUILTIN_PROPOSERS``).
    """

    help: str
    check: Callable[..., None] | None = None
    proposer: Callable[..., object] | None = None


DRAFT_SOURCES: dict[str, DraftSource] = {
    "lookup_first": DraftSource("prompt lookup where the context repeats, else the DFlash drafter or the mask slots"),
    "slots": DraftSource("a hybrid model's own mask slots"),
    "lookup": DraftSource("prompt lookup only (any causal model)"),
    "dflash": DraftSource("the DFlash drafter only (--speculative-config)"),
}

# remasking name -> confidence; Dream's ``maskgit_plus`` is ``low_confidence``.
REMASKING: dict[str, Confidence] = {
    "low_confidence": Confidence(low_confidence, "probability of the predicted token (LLaDA; Dream's maskgit_plus)"),
    "random": Confidence(random_confidence, "uniform scores: random positions (LLaDA)"),
    "margin": Confidence(margin_confidence, "top-1 minus top-2 probability (Dream's topk_margin)"),
    "entropy": Confidence(neg_entropy_confidence, "negative entropy (Dream's entropy alg; not --decoding entropy)"),
}
