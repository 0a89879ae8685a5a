"""One denoising step over a batch of rows that may each have their own settings.

Shared by the reference samplers (``celeris.reference``) and the engine (``celeris.engine``), so both commit
tokens by exactly the same rules: ``commit_step`` is the one composition grammar -> ``denoise_step`` -> grammar
correction -> progress check that every masked and block path runs.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Collection
from dataclasses import dataclass, replace

import torch

from celeris.sampling.dry import DrySettings, apply_dry, row_penalties
from celeris.sampling.params import SamplingParams
from celeris.sampling.rules import COMMIT_RULES, NEEDS, REMASKING
from celeris.sampling.select import NEG_INF, min_p_filter, sample_tokens, top_k_filter, top_p_filter
from celeris.structured.grammar import Constraint, constrain_commits, grammar_step


class NoProgressError(RuntimeError):
    """A denoising step committed no token for a row that still has masked positions (its scores were
    not finite numbers); raised instead of looping forever (the engine ends such a request with
    finish reason "error" and code "no_progress")."""


CONFIDENCE_FROM = ("filtered", "unfiltered")


def confidence_rule(model: torch.nn.Module) -> str:
    """Which distribution a format's published sampler takes confidences from (``denoise_step``'s
    ``confidence_from``): a model class's ``confidence_from``, else "filtered"."""
    rule = getattr(model, "confidence_from", "filtered")
    return rule if rule in CONFIDENCE_FROM else "filtered"


def banned_token_ids(config: object) -> list[int]:
    """Ids a denoising step must never produce: the mask token, and padding unless it doubles as
    end-of-text (LLaDA and Dream pad with their end-of-text token, which must stay producible). Ids outside
    the vocabulary are left out: a causal checkpoint's mask placeholder (``celeris.models.causal``) is no logit."""
    ids = [config.mask_token_id]
    if config.pad_token_id != config.eos_token_id:
        ids.append(config.pad_token_id)
    vocab = getattr(config, "vocab_size", None)
    return [i for i in ids if vocab is None or 0 <= i < vocab]


def make_generator(seed: int | None) -> torch.Generator:
    """CPU RNG for one request; a fresh random seed when ``seed`` is None."""
    return torch.Generator().manual_seed(seed if seed is not None else random.getrandbits(63))


@dataclass(slots=True)
class RowSettings:
    """Per-row sampling settings as tensors, built for the rows of one step.

    Shapes: ``temperature``/``top_p``/``min_p`` (B,), ``top_k`` (B,) int64; ``cfg_scale`` (B, 1); ``repetition_penalty``,
    ``frequency_penalty``, ``presence_penalty`` (B, 1, 1). ``rule_values`` holds, for every numeric setting the rows'
    commit rules declare (``CommitRule.params``: ``threshold``, ``factor``, ...), a (B, 1) float64 column that
    broadcasts against (B, L) confidences (taken through float32, as every float setting).
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    cfg_scale: torch.Tensor
    repetition_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    remasking: list[str]
    decoding: list[str]
    rule_values: dict[str, torch.Tensor]
    # which optional stages some row needs, decided from the Python settings (no device sync in the step)
    any_cfg: bool = False
    any_penalty: bool = False
    any_frequency_penalty: bool = False
    any_presence_penalty: bool = False
    any_top_p: bool = False
    any_top_k: bool = False
    any_min_p: bool = False
    any_sampling: bool | None = None  # some row samples (temperature > 0); None: not known (read the tensor)

    @property
    def any_count_penalty(self) -> bool:
        """Some row has a frequency or presence penalty (what ``History.counts`` is for)."""
        return self.any_frequency_penalty or self.any_presence_penalty

    @classmethod
    def from_params(cls, rows: list[SamplingParams], device: torch.device) -> RowSettings:
        def col(name: str) -> torch.Tensor:
            return torch.tensor([float(getattr(r, name)) for r in rows], device=device)

        declared = {p for r in rows for p in COMMIT_RULES[r.decoding].params}
        numeric = sorted(p for p in declared if all(isinstance(getattr(r, p), int | float) for r in rows))
        return cls(
            temperature=col("temperature"),
            top_p=col("top_p"),
            top_k=torch.tensor([r.top_k for r in rows], dtype=torch.long, device=device),
            min_p=col("min_p"),
            cfg_scale=col("cfg_scale")[:, None],
            repetition_penalty=col("repetition_penalty")[:, None, None],
            frequency_penalty=col("frequency_penalty")[:, None, None],
            presence_penalty=col("presence_penalty")[:, None, None],
            remasking=[r.remasking for r in rows],
            decoding=[r.decoding for r in rows],
            rule_values={p: col(p)[:, None].double() for p in numeric},
            any_cfg=any(r.cfg_scale > 0 for r in rows),
            any_penalty=any(r.repetition_penalty != 1 for r in rows),
            any_frequency_penalty=any(r.frequency_penalty != 0 for r in rows),
            any_presence_penalty=any(r.presence_penalty != 0 for r in rows),
            any_top_p=any(r.top_p < 1 for r in rows),
            any_top_k=any(r.top_k > 0 for r in rows),
            any_min_p=any(r.min_p > 0 for r in rows),
            any_sampling=any(r.temperature > 0 for r in rows),
        )


def context_tokens(canvases: list[torch.Tensor], vocab_size: int, mask_id: int, device: torch.device) -> torch.Tensor:
    """(B, V) bool: which tokens occur in each row's canvas (1-D int64 each), the mask token excluded (a mask
    placeholder past the vocabulary, ``celeris.models.causal``, included)."""
    padded = torch.nn.utils.rnn.pad_sequence(list(canvases), batch_first=True, padding_value=mask_id).to(device)
    seen = torch.zeros((padded.shape[0], max(vocab_size, mask_id + 1)), dtype=torch.bool, device=device)
    seen.scatter_(1, padded, True)
    seen[:, mask_id] = False
    return seen[:, :vocab_size]


def before_end(answer: torch.Tensor, ends: Collection[int]) -> torch.Tensor:
    """``answer`` (1-D int64) up to its first id in ``ends`` (excluded): what of it is the answer's text."""
    if not ends:
        return answer
    hit = torch.isin(answer, torch.tensor(sorted(ends), device=answer.device)).nonzero()
    return answer[: int(hit[0])] if hit.numel() else answer


def answer_counts(answers: list[torch.Tensor], vocab_size: int, mask_id: int, device: torch.device,
                  ends: list[Collection[int]] | None = None) -> torch.Tensor:
    """(B, V) float32: how often each token occurs in each row's answer so far (1-D int64 each), counted up to the
    row's first end id in ``ends`` (None: no end ids): neither the end-of-text a masked-diffusion answer is filled
    with after its text nor anything after it counts (vLLM never counts past the end); the mask token, which marks
    positions not committed yet, never counts."""
    if ends is not None:
        answers = [before_end(a, e) for a, e in zip(answers, ends, strict=True)]
    padded = torch.nn.utils.rnn.pad_sequence(list(answers), batch_first=True, padding_value=mask_id).to(device)
    counts = torch.zeros((padded.shape[0], max(vocab_size, mask_id + 1)), device=device)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    counts[:, mask_id] = 0
    return counts[:, :vocab_size]


@dataclass(slots=True)
class History:
    """The tokens the penalties read, per row (each None when no row needs it):

    - ``seen``: (B, V) bool, the tokens of the prompt and the answer so far (``context_tokens``; CTRL's repetition
      penalty), or (B, L, V) where each position has its own (verified decoding's ``penalize_along``);
    - ``counts``: (B, V) float32, each token's occurrences in the answer so far (``answer_counts``; OpenAI's
      frequency and presence penalties, which, as in vLLM, do not count the prompt), or (B, L, V).
    """

    seen: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    dry: list[list[dict[int, float] | None]] | None = None  # per row and position, DRY's penalties (``dry_penalties``)

    @classmethod
    def of(cls, settings: RowSettings, contexts: list[torch.Tensor], answers: list[torch.Tensor],
           vocab_size: int, mask_id: int, device: torch.device,
           ends: list[Collection[int]] | None = None, dry: list[DrySettings | None] | None = None) -> History | None:
        """The history of rows (``settings``: which penalties some row has) whose prompt-and-answer tokens are
        ``contexts`` and answer tokens ``answers`` (1-D int64 each, ``mask_id`` where not committed; counted up to
        each row's first id in ``ends``: ``answer_counts``); with ``dry`` (each row's DRY settings or None), DRY's
        penalties after each row's context (``row_penalties``). None when no row has a penalty."""
        penalties = None if dry is None else row_penalties(dry, contexts)
        if not (settings.any_penalty or settings.any_count_penalty or penalties is not None):
            return None
        return cls(context_tokens(contexts, vocab_size, mask_id, device) if settings.any_penalty else None,
                   answer_counts(answers, vocab_size, mask_id, device, ends) if settings.any_count_penalty else None,
                   penalties)

    def add(self, tokens: list[int]) -> None:
        """Count newly committed ``tokens`` into a one-row history (verified decoding's ``DraftRow``)."""
        ids = torch.tensor(tokens, dtype=torch.long, device=(self.seen if self.counts is None else self.counts).device)
        if self.seen is not None:
            self.seen[0, ids] = True
        if self.counts is not None:
            self.counts[0].index_add_(0, ids, torch.ones(len(tokens), device=ids.device))


def apply_penalties(logits: torch.Tensor, settings: RowSettings, history: History | None) -> torch.Tensor:
    """The penalties in vLLM's order (``apply_penalties``): CTRL's repetition penalty (``penalize_repetition``), then
    OpenAI's frequency and presence penalties, ``logit - frequency_penalty * count - presence_penalty * (count > 0)``
    (OpenAI's API reference, "Frequency and presence penalties"), then DRY's (``history.dry``,
    ``celeris.sampling.dry``: llama.cpp's order). logits (B, L, V) float32; rows without a penalty unchanged; a new
    tensor when some row has one."""
    if history is None:
        return logits
    if history.dry is not None:
        return apply_dry(apply_penalties(logits, settings, replace(history, dry=None)).clone(), history.dry)
    if history.seen is not None and settings.any_penalty:
        logits = penalize_repetition(logits, history.seen, settings.repetition_penalty)
    if history.counts is not None and settings.any_count_penalty:
        counts = history.counts[:, None, :] if history.counts.dim() == 2 else history.counts
        # a term whose penalty is 0 in every row subtracts exact zeros: left out, the same tensor at fewer passes
        if settings.any_frequency_penalty:
            logits = logits - settings.frequency_penalty * counts
        if settings.any_presence_penalty:
            logits = logits - settings.presence_penalty * (counts > 0)
    return logits


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor | float) -> torch.Tensor:
    """CTRL's repetition penalty (arXiv:1909.05858): logits (B, L, V) of tokens with ``seen`` (B, V), or (B, L, V)
    where each position has its own context, divided by ``penalty`` (B, 1, 1) when positive, multiplied when
    negative."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen[:, None, :] if seen.dim() == 2 else seen, penalized, logits)


def filter_logits(logits: torch.Tensor, settings: RowSettings) -> torch.Tensor:
    """Nucleus then top-k filtering of (B, L, V) logits per row (Dream's ``sample_tokens`` order), then min-p (as
    vLLM, after top-k and top-p); rows with ``top_p`` 1, ``top_k`` 0 and ``min_p`` 0 unchanged."""
    if settings.any_top_p:
        logits = top_p_filter(logits, settings.top_p)
    if settings.any_top_k:
        logits = top_k_filter(logits, settings.top_k)
    if settings.any_min_p:
        logits = min_p_filter(logits, settings.min_p)
    return logits


def prepare_logits(
    logits: torch.Tensor, settings: RowSettings, banned_ids: list[int], history: History | None = None,
    allowed: torch.Tensor | None = None, keep_unfiltered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits pipeline shared by the denoising step and next-token decoding (``generate_autoregressive``):
    the penalties (rows with one, given their ``history``: ``apply_penalties``), then the banned ids and the tokens a
    grammar does not allow (``allowed`` (B, L, V) bool) to -inf, then top-p and top-k (``filter_logits``).

    Args:
        logits: (B, L, V) float32; not modified.
        keep_unfiltered: also return the logits after the penalty, before anything is removed (the
            distribution LLaDA's published sampler takes confidences from).

    Returns:
        (filtered (B, L, V), unfiltered (B, L, V) or None).
    """
    logits = apply_penalties(logits.clone(), settings, history)
    unfiltered = logits.clone() if keep_unfiltered else None  # (B, L, V) before the ban
    logits[..., banned_ids] = NEG_INF
    if allowed is not None:
        logits = logits.masked_fill(~allowed, NEG_INF)
    return filter_logits(logits, settings), unfiltered


def check_prompts(prompt_ids: list[list[int]]) -> None:
    """Raise ValueError("prompt must not be empty") when a prompt has no token: every sampler and the engine
    need at least one token of context."""
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("prompt must not be empty")


def _rows_with(values: list[str], name: str, device: torch.device) -> torch.Tensor:
    return torch.tensor([v == name for v in values], device=device)[:, None]  # (B, 1)


def denoise_step(
    logits: torch.Tensor,
    block: torch.Tensor,
    mask_id: int,
    banned_ids: list[int],
    num_tokens: torch.Tensor,
    settings: RowSettings,
    generators: list[torch.Generator],
    history: History | None = None,
    lengths: list[int] | None = None,
    confidence_from: str = "filtered",
    allowed: torch.Tensor | None = None,
    force: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predict every masked position of the block and commit some of them.

    Args:
        logits: (B, L, V) float32 logits for the block's positions (after CFG).
        block: (B, L) int64 current tokens of the block (``mask_id`` = still masked;
            rows shorter than L are padded with non-mask ids).
        banned_ids: ids never produced (the mask and padding tokens).
        num_tokens: (B,) int64 tokens to commit this step under ``fixed`` decoding.
        settings / generators: per-row settings and RNGs.
        history: the tokens the rows' penalties read (``History.of``), needed when a row has a
            ``repetition_penalty``, ``frequency_penalty`` or ``presence_penalty``.
        lengths: each row's own block width (<= L), so its random draws depend on its own block
            alone, not on the widest block sharing the step; None: every row is L wide.
        confidence_from: the distribution whose probabilities rank positions (``low_confidence``) and give
            entropies: "filtered" (after ``top_p`` and ``top_k`` are removed, as Dream's and SDAR's published
            samplers take them; Celeris also removes the banned ids, which neither published sampler filters: they
            softmax over the whole vocabulary, the mask token included) or "unfiltered" (``softmax(logits)`` over
            the whole vocabulary, the mask token included, as LLaDA's published ``generate()``; the predicted token
            still never is a banned id).
        allowed: (B, L, V) bool, the tokens a grammar accepts at each position (``celeris.structured``), or
            None; the others are removed with the banned ids, so they are never predicted.
        force: (B, L) bool positions committed (where masked) whatever the commit rule says, or None (a
            grammar's leftmost open position: ``celeris.structured.grammar.grammar_step``).

    Returns:
        (new block (B, L) int64, committed positions (B, L) bool).
    """
    if allowed is None and force is None and (single := greedy_single(logits, block, mask_id, banned_ids, num_tokens,
                                                                       settings, history, confidence_from)) is not None:
        return single
    logits, unfiltered = prepare_logits(logits, settings, banned_ids, history, allowed,
                                        keep_unfiltered=confidence_from == "unfiltered")
    x0 = sample_tokens(logits, settings.temperature, generators, lengths, settings.any_sampling)  # (B, L)
    if allowed is None and force is None and (single := commit_single(logits, x0, block, mask_id, num_tokens,
                                                                       settings, confidence_from)) is not None:
        return single
    return rank_and_commit(logits, unfiltered, x0, block, mask_id, num_tokens, settings, generators, lengths, force)


SINGLE_RULES = ("fixed", "low_confidence_static")  # commit rules that commit the one masked position of a block


def greedy_single(logits: torch.Tensor, block: torch.Tensor, mask_id: int, banned_ids: list[int],
                  num_tokens: torch.Tensor, settings: RowSettings, history: History | None,
                  confidence_from: str) -> tuple | None:
    """``denoise_step``'s result for greedy next-token decoding through the masked path (a block of one column, no
    sampling, top-k/p or min-p, no repetition penalty: ``commit_single``'s case) in one kernel pass a row
    (``celeris.models.fast_ops.penalized_argmax``: the frequency and presence penalties, the ban and the argmax,
    the same ids as ``prepare_logits`` then ``sample_tokens``); None where that does not apply or a row's chosen
    logit is not finite (then the caller's path decides, as ``commit_single``). (B, 1, V) logits, (B, 1) block."""
    fast_ops = sys.modules.get("celeris.models.fast_ops")  # the model side loaded (as ``sample_tokens``)
    if fast_ops is None or settings.any_sampling is not False or settings.any_top_p or settings.any_top_k \
            or settings.any_min_p or settings.any_penalty \
            or not commits_its_column(block, num_tokens, settings, confidence_from) \
            or (history is not None and history.dry is not None):  # DRY: prepare_logits's order
        return None
    counts = None
    if history is not None and settings.any_count_penalty:
        counts = history.counts if history.counts is not None and history.counts.dim() == 2 else None
        if counts is None:
            return None
    frequency = settings.frequency_penalty if counts is not None and settings.any_frequency_penalty else None
    presence = settings.presence_penalty if counts is not None and settings.any_presence_penalty else None
    done = fast_ops.penalized_argmax(logits[:, 0], counts, frequency, presence, banned_ids)
    if done is None or not bool(torch.isfinite(done[1]).all()):
        return None
    return _commit_column(done[0][:, None].to(block.device), block, mask_id)


def commits_its_column(block: torch.Tensor, num_tokens: torch.Tensor, settings: RowSettings,
                       confidence_from: str) -> bool:
    """Whether every row's rule commits the masked position of its block of one column whatever the confidences
    (``fixed``, ``low_confidence`` from the filtered logits, ``num_tokens`` >= 1): ``commit_single``'s and
    ``greedy_single``'s case. (B, 1) block, (B,) num_tokens."""
    return block.shape[1] == 1 and confidence_from == "filtered" \
        and all(r == "low_confidence" for r in settings.remasking) \
        and all(d in SINGLE_RULES for d in settings.decoding) and not bool((num_tokens < 1).any())


def _commit_column(x0: torch.Tensor, block: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(new block, committed) of blocks of one column whose masked position takes ``x0`` (B, 1)."""
    chosen = block == mask_id  # (B, 1)
    return torch.where(chosen, x0, block), chosen


def commit_single(logits: torch.Tensor, x0: torch.Tensor, block: torch.Tensor, mask_id: int,
                  num_tokens: torch.Tensor, settings: RowSettings, confidence_from: str) -> tuple | None:
    """``rank_and_commit``'s result without its confidences, where it is known without them: a block of one column
    (next-token decoding through the masked path), every row committing its ``num_tokens`` >= 1 most confident
    masked positions by probability (``fixed``, ``low_confidence``, from the filtered logits). Such a rule commits
    the masked position unless its confidence is NaN, which happens only when the filtered logits hold a NaN or
    +inf, or nothing but -inf: then ``x0``'s logit (the argmax, or a Gumbel-max sample, of those logits) is not
    finite, and this returns None (the caller ranks). (B, 1, V) filtered logits, (B, 1) ``x0`` and ``block``."""
    if not commits_its_column(block, num_tokens, settings, confidence_from) \
            or not bool(torch.isfinite(logits.gather(-1, x0[..., None])).all()):
        return None
    return _commit_column(x0, block, mask_id)


def rank_and_commit(logits: torch.Tensor, unfiltered: torch.Tensor | None, x0: torch.Tensor, block: torch.Tensor,
                    mask_id: int, num_tokens: torch.Tensor, settings: RowSettings, generators: list[torch.Generator],
                    lengths: list[int] | None, force: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``denoise_step`` after its predictions ``x0`` (B, L): each row's confidences (its remasking) ranked by its
    commit rule, the ``force``d positions added; returns (new block (B, L), committed (B, L) bool)."""
    probs = (logits if unfiltered is None else unfiltered).softmax(-1)  # (B, L, V)
    is_masked = block == mask_id  # (B, L)
    conf = torch.full(x0.shape, NEG_INF, dtype=torch.float64, device=x0.device)
    for name in set(settings.remasking):
        rows = _rows_with(settings.remasking, name, x0.device)
        row_generators = [g if r == name else None for g, r in zip(generators, settings.remasking, strict=True)]
        conf = torch.where(rows, REMASKING[name].fn(probs, x0, row_generators, lengths), conf)
    conf = conf.masked_fill(~is_masked, NEG_INF)  # (B, L)
    chosen = torch.zeros_like(is_masked)
    for name in set(settings.decoding):
        rows = _rows_with(settings.decoding, name, x0.device)
        rule = COMMIT_RULES[name]
        needs = {need: NEEDS[need](probs) for need in rule.needs}  # e.g. (B, L) entropies
        values = {p: settings.rule_values[p] for p in rule.params}  # (B, 1) each
        chosen = torch.where(rows, rule.fn(conf, num_tokens=num_tokens, **values, **needs), chosen)
    if force is not None:
        chosen |= force
    chosen &= is_masked
    return torch.where(chosen, x0, block), chosen


@dataclass(slots=True)
class StepCommit:
    """What ``commit_step`` did to a (B, L) block.

    Attributes:
        block: (B, L) int64 the block after the step (same device as the logits).
        committed: (B, L) bool the positions committed this step.
        stalled: (B,) bool rows that still had a masked position and committed none (their scores were not finite
            numbers): the reference raises ``NoProgressError``, the engine ends them with code "no_progress".
        allowed: the grammar's (B, L, V) bool mask of allowed tokens, or None when no row has a grammar (the
            processed log-probabilities are taken under it).
    """

    block: torch.Tensor
    committed: torch.Tensor
    stalled: torch.Tensor
    allowed: torch.Tensor | None


def commit_step(
    logits: torch.Tensor,
    block: torch.Tensor,
    mask_id: int,
    eos_id: int,
    banned_ids: list[int],
    num_tokens: torch.Tensor,
    settings: RowSettings,
    generators: list[torch.Generator],
    history: History | None = None,
    lengths: list[int] | None = None,
    confidence_from: str = "filtered",
    constraints: list[Constraint | None] | None = None,
    left: list[int] | None = None,
    force: torch.Tensor | None = None,
) -> StepCommit:
    """One commit of a block: the grammar's masks (``grammar_step``), ``denoise_step``, the grammar's correction
    (``constrain_commits``), then which rows made no progress. The masked-diffusion and block-diffusion paths of
    the engine and their reference samplers all commit through here, so they cannot drift apart.

    Args:
        logits / block / mask_id / banned_ids / num_tokens / settings / generators / history / lengths /
            confidence_from: as ``denoise_step`` ((B, L, V) float32 logits, (B, L) int64 block, (B,) int64 counts).
        eos_id: the end-of-text id a row whose grammar has ended fills its open positions with.
        constraints: one ``Constraint`` or None per row (None: no row has a grammar).
        left: per row, the answer positions from the block's first column to the end of the answer (needed when a
            row has a constraint).
        force: (B, L) bool positions committed whatever the rule says (a block model's pending first token), or
            None; OR-ed with the grammar's own forced position.

    Returns:
        ``StepCommit`` (the new block, the committed positions, the stalled rows, the grammar's mask).
    """
    rows = constraints if constraints is not None else [None] * block.shape[0]
    grammar = grammar_step(rows, block, mask_id, left if left is not None else [0] * len(rows), logits.shape[-1],
                           logits.device)
    if grammar.force is not None:
        force = grammar.force if force is None else force | grammar.force
    new, committed = denoise_step(logits, block, mask_id, banned_ids, num_tokens, settings, generators, history,
                                  lengths, confidence_from, grammar.allowed, force)
    new, committed = constrain_commits(rows, grammar, block, new, committed, mask_id, eos_id)
    stalled = (block == mask_id).any(-1) & ~committed.any(-1)  # (B,)
    return StepCommit(new, committed, stalled, grammar.allowed)


def guided(cond: torch.Tensor, uncond: torch.Tensor, cfg_scale: torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance: u + (s + 1)(c - u) (LLaDA arXiv:2502.09992 Eq. 16; SMDM arXiv:2410.18514).

    ``cfg_scale`` (B, 1) broadcasts over (B, L, V); s = 0 returns ``cond``.
    """
    return uncond + (cfg_scale[..., None] + 1) * (cond - uncond)
