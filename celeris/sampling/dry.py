"""DRY ("Don't Repeat Yourself"), a penalty on the tokens that would extend a repeat of earlier context.

Designed by p-e-w (text-generation-webui PR #5677); the rule here is llama.cpp's ``llama_sampler_dry_apply``
(``src/llama-sampling.cpp``, ported there from koboldcpp PR #982 by pi6am), the sampler its server and
llama-cpp-python expose as ``dry_multiplier``, ``dry_base``, ``dry_allowed_length``, ``dry_penalty_last_n`` and
``dry_sequence_breakers``. For the last ``n`` tokens of the context (prompt and answer; ``dry_penalty_last_n``, -1:
all of it), each earlier position j gets the length of the longest suffix of the context that also ends at j,
capped at the distance back to the last sequence breaker (a breaker ends every repeat). The token after j would
extend that repeat: it gets, once per token (its longest repeat L), the penalty
``dry_multiplier * dry_base ** (L - dry_allowed_length)`` where L >= ``dry_allowed_length``, subtracted from its logit
(the exponent clamped where the power would overflow float32, as llama.cpp clamps it); a breaker token itself is
never penalized. So a phrase repeated once costs little, a loop costs more with every token it goes on.

One divergence from llama.cpp, as in vLLM's proposal (vllm-project/vllm PR #50584): a sequence breaker is a set of
single tokens, every token whose text contains one of the breaker strings (llama.cpp also matches a breaker spelled
over several tokens). The penalty is applied after the repetition, frequency and presence penalties, in llama.cpp's
default sampler order (``penalties;dry;...``). Applied to causal decoding only (next-token and verified decoding,
each position under its own context, so verified decoding's answer is the next-token answer).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from celeris.sampling.params import DRY_SEQUENCE_BREAKERS  # noqa: F401 - the defaults, re-exported

FLOAT_MAX_LOG = 88.7228391  # log(float32's largest value): the exponent's clamp (llama.cpp's)


@dataclass(frozen=True, slots=True)
class DrySettings:
    """One request's DRY settings, its breakers as token ids (``breaker_ids``).

    Attributes:
        multiplier: ``dry_multiplier`` (> 0: on). base: ``dry_base`` (>= 1). allowed_length: repeats of at most
            this many tokens are free. last_n: tokens of the context looked at (-1: all). breakers: token ids that
            end every repeat.
    """

    multiplier: float
    base: float
    allowed_length: int
    last_n: int
    breakers: frozenset[int] = frozenset()

    @property
    def max_exponent(self) -> int:
        """The clamp of ``L - allowed_length`` (0: none, a base of 1)."""
        return int(FLOAT_MAX_LOG / math.log(self.base)) if self.base > 1.000001 else 0

    @classmethod
    def of(cls, params: object, model: object | None = None) -> DrySettings | None:
        """The settings of a request's ``SamplingParams`` (None when its ``dry_multiplier`` is 0 or its
        ``dry_penalty_last_n`` 0), its breaker strings resolved on ``model``'s vocabulary (``breaker_ids``)."""
        if not params.dry_multiplier or not params.dry_penalty_last_n:
            return None
        return cls(params.dry_multiplier, params.dry_base, params.dry_allowed_length, params.dry_penalty_last_n,
                   breaker_ids(model, tuple(params.dry_sequence_breakers)))


def attach_vocabulary(model: object, texts: Callable[[], Sequence[str]]) -> None:
    """Give ``model`` its vocabulary's texts, which ``breaker_ids`` reads: ``texts()`` (called at the first request
    with DRY) gives each token id's text decoded alone. A model without it (a tiny test model) has no breakers."""
    model.dry_token_texts = texts
    model.dry_breaker_cache = {}


def breaker_ids(model: object | None, breakers: tuple[str, ...]) -> frozenset[int]:
    """The ids of every token whose text contains one of ``breakers`` (empty strings skipped), on the vocabulary
    ``attach_vocabulary`` gave ``model``; empty when it gave none. Cached per breaker tuple."""
    texts = getattr(model, "dry_token_texts", None)
    if texts is None or not breakers:
        return frozenset()
    cache = model.dry_breaker_cache
    if breakers not in cache:
        if getattr(model, "dry_vocabulary", None) is None:  # the vocabulary's texts, once
            model.dry_vocabulary = list(texts())
        wanted = [b for b in breakers if b]
        cache[breakers] = frozenset(i for i, t in enumerate(model.dry_vocabulary) if any(b in t for b in wanted))
    return cache[breakers]


def dry_penalties(tokens: Sequence[int], dry: DrySettings) -> dict[int, float]:
    """The penalty of each token DRY penalizes after the context ``tokens`` (oldest first): {token id: amount to
    subtract from its logit}; empty when nothing repeats long enough.

    The suffix-match lengths (what llama.cpp computes with the Z-algorithm over the reversed window) are grown a
    token at a time over the earlier positions still matching, vectorized: as many rounds as the longest repeat,
    which is capped at the distance to the last breaker and, where the exponent's clamp binds, at
    ``allowed_length`` + the clamp (a longer repeat gets the same penalty).
    """
    n = len(tokens) if dry.last_n < 0 else min(len(tokens), dry.last_n)
    if n <= dry.allowed_length:
        return {}
    r = np.asarray(tokens[len(tokens) - n :], dtype=np.int64)[::-1]  # r[0] is the last token
    breaks = np.flatnonzero(np.isin(r, list(dry.breakers))) if dry.breakers else ()
    limit = int(breaks[0]) if len(breaks) else n  # a repeat never reaches back past a breaker
    if limit < dry.allowed_length:
        return {}
    top = dry.max_exponent
    cap = min(limit, dry.allowed_length + top) if top else limit
    ends = np.arange(1, n)  # the earlier repeat ends k tokens before the last one, k = 1 .. n - 1
    length = 0
    found: list[tuple[np.ndarray, int]] = []  # (k's whose repeat is exactly this long, its length)
    while len(ends) and length < cap:
        fits = ends + length < n
        same = np.zeros(len(ends), dtype=bool)
        same[fits] = r[ends[fits] + length] == r[length]
        if length >= dry.allowed_length and not same.all():
            found.append((ends[~same], length))
        ends, length = ends[same], length + 1
    if len(ends) and length >= dry.allowed_length:  # still matching at the cap
        found.append((ends, length))
    longest: dict[int, int] = {}
    for ks, m in found:  # the token after the earlier repeat: r[k - 1]
        for t in r[ks - 1].tolist():
            if m > longest.get(t, -1):
                longest[t] = m
    out = {}
    for t, m in longest.items():
        if t not in dry.breakers:
            out[t] = dry.multiplier * dry.base ** (min(m - dry.allowed_length, top) if top else m - dry.allowed_length)
    return out


def row_penalties(dry: Sequence[DrySettings | None], contexts: Sequence[torch.Tensor]) -> list[list[dict | None]] | None:
    """``History.dry`` for one position a row: each row's ``dry_penalties`` after its ``contexts`` (1-D int64, its
    committed tokens in order), None for a row without DRY; None when no row has DRY."""
    if all(d is None for d in dry):
        return None
    return [[None if d is None else dry_penalties(t.tolist(), d)] for d, t in zip(dry, contexts, strict=True)]


def apply_dry(logits: torch.Tensor, penalties: Sequence[Sequence[dict[int, float] | None]]) -> torch.Tensor:
    """``logits`` (B, L, V) float32 less each position's penalties (``penalties[b][l]``, a ``dry_penalties``
    result, or None for a row without DRY), in place; returned."""
    for b, row in enumerate(penalties):
        for pos, found in enumerate(row):
            if found:
                ids = torch.tensor(list(found), dtype=torch.long, device=logits.device)
                amounts = torch.tensor(list(found.values()), dtype=logits.dtype, device=logits.device)
                logits[b, pos, ids] -= amounts
    return logits
