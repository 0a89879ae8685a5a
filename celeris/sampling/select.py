"""Per-step token choice for masked diffusion: sampling, filtering and the remasking confidences
(the commit rules and the registries that name them are in ``celeris.sampling.rules``).

Every function is vectorised over the batch; shapes use B (batch), L (positions
of the block being denoised) and V (vocabulary).
"""

from __future__ import annotations

import sys

import torch

NEG_INF = float("-inf")


def uniform(
    shape: tuple[int, ...], generators: list[torch.Generator | None], device: torch.device,
    lengths: list[int] | None = None,
) -> torch.Tensor:
    """U(0, 1) float64 draws of ``shape`` = (B, L, ...), row b from ``generators[b]`` (zeros where None).

    One generator per request keeps a request's randomness independent of which
    other requests share its batch (so a seed means the same thing alone or
    batched); that is why this draws row by row, and only for rows that need it.
    ``lengths`` (B ints <= L) are the rows' own block widths: row b draws only
    (lengths[b], ...) numbers and the padding columns after them are 0, so its
    draws do not depend on how wide the widest block sharing its step is.
    """
    lengths = lengths or [shape[1]] * shape[0]
    rows = []
    for g, n in zip(generators, lengths, strict=True):
        row = torch.zeros(shape[1:], dtype=torch.float64)
        if g is not None:
            row[:n] = torch.rand((n, *shape[2:]), generator=g, dtype=torch.float64)
        rows.append(row)
    return torch.stack(rows).to(device)


def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filtering (arXiv:1904.09751): keep the smallest set of tokens whose mass >= top_p.

    Args:
        logits: (B, L, V) float32.
        top_p: (B,) float in (0, 1]; rows with 1.0 are unchanged.

    Returns:
        (B, L, V) logits with the excluded tokens set to -inf (the top token is always kept).
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, L, V)
    cum = sorted_logits.softmax(-1).cumsum(-1)  # (B, L, V)
    drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p[:, None, None]  # mass before this token
    drop_sorted[..., 0] = False  # whatever top_p is (even one float32 rounds to 0), a token stays possible
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


def probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """(L, V) float logits -> (L, V) float64 probabilities after top-p (``top_p_filter``) and temperature
    (temperature > 0): the next-token distribution p that speculative sampling keeps (``celeris.sampling.verified``)
    and the draft distribution q of sampled drafts."""
    if top_p < 1:
        logits = top_p_filter(logits[None], torch.tensor([top_p], device=logits.device))[0]
    return (logits.double() / temperature).softmax(-1)


def top_k_filter(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k filtering (Fan et al. 2018, arXiv:1805.04833) as Dream's ``top_k_logits`` (DreamLM
    ``generation_utils.py``): tokens whose logit is below the k-th largest are excluded; ties with it stay.

    Args:
        logits: (B, L, V) float32.
        top_k: (B,) int64 >= 0; rows with 0 are unchanged, k > V keeps every token.

    Returns:
        (B, L, V) logits with the excluded tokens set to -inf.
    """
    k = top_k.clamp(1, logits.shape[-1]).to(logits.device)  # (B,)
    kth = logits.topk(int(k.max()), dim=-1).values  # (B, L, k_max) descending
    kth = kth.gather(-1, (k - 1)[:, None, None].expand(-1, logits.shape[1], 1))  # (B, L, 1): each row's k-th
    drop = (logits < kth) & (top_k > 0).to(logits.device)[:, None, None]
    return logits.masked_fill(drop, NEG_INF)


def min_p_filter(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Min-p filtering (Nguyen et al. 2024, arXiv:2407.01082; vLLM's ``min_p``): tokens whose probability is below
    ``min_p`` times the most likely token's are excluded.

    Args:
        logits: (B, L, V) float32.
        min_p: (B,) float in [0, 1]; rows with 0 are unchanged (the most likely token always stays).

    Returns:
        (B, L, V) logits with the excluded tokens set to -inf.
    """
    probs = logits.softmax(-1)  # (B, L, V)
    floor = min_p.to(logits.device)[:, None, None] * probs.max(-1, keepdim=True).values  # (B, L, 1)
    return logits.masked_fill(probs < floor, NEG_INF)


def sample_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, generators: list[torch.Generator],
    lengths: list[int] | None = None, sampling: bool | None = None,
) -> torch.Tensor:
    """Gumbel-max sampling in float64 (arXiv:2409.02908: low-precision noise hurts quality).

    argmax(logits / T + g), g = -log(-log U), is an exact sample from softmax(logits / T);
    rows with T = 0 take argmax(logits).

    Args:
        logits: (B, L, V) float32. temperature: (B,) float.
        lengths: each row's own block width (<= L; ``uniform``), None: all L.
        sampling: whether some row's temperature is above 0, when the caller knows (``RowSettings.any_sampling``);
            None: read from ``temperature``.

    Returns:
        (B, L) int64 token ids.
    """
    # the kernel's argmax once the model side is loaded (`import celeris` with its SamplingParams loads no model
    # module); the same ids as torch's
    fast_ops = sys.modules.get("celeris.models.fast_ops")
    greedy = logits.argmax(-1) if fast_ops is None else fast_ops.argmax(logits)  # (B, L)
    if not (bool((temperature > 0).any()) if sampling is None else sampling):
        return greedy
    needs = [g if t > 0 else None for g, t in zip(generators, temperature.tolist(), strict=True)]
    u = uniform(tuple(logits.shape), needs, logits.device, lengths).clamp_(min=1e-300)  # (B, L, V)
    gumbel = -torch.log(-torch.log(u))
    t = temperature.double().clamp(min=1e-6)[:, None, None]
    sampled = (logits.double() / t + gumbel).argmax(-1)  # (B, L)
    return torch.where(temperature[:, None] > 0, sampled, greedy)


def low_confidence(
    probs: torch.Tensor, x0: torch.Tensor, generators: list[torch.Generator], lengths: list[int] | None = None
) -> torch.Tensor:
    """Confidence = model probability of the predicted token: (B, L, V), (B, L) -> (B, L) float64."""
    return probs.gather(-1, x0[..., None]).squeeze(-1).double()


def random_confidence(
    probs: torch.Tensor, x0: torch.Tensor, generators: list[torch.Generator], lengths: list[int] | None = None
) -> torch.Tensor:
    """Random remasking: a uniform score per position, so committed positions are random."""
    return uniform(tuple(x0.shape), generators, x0.device, lengths)


def margin_confidence(
    probs: torch.Tensor, x0: torch.Tensor, generators: list[torch.Generator], lengths: list[int] | None = None
) -> torch.Tensor:
    """Margin confidence = top-1 minus top-2 probability of the position's distribution: (B, L, V) -> (B, L)
    float64 in [0, 1]. Dream's ``alg="topk_margin"`` (``margin_confidence`` in DreamLM's ``sample_tokens``,
    arXiv:2508.15487); it does not depend on which token was sampled."""
    top2 = probs.topk(2, dim=-1).values.double()  # (B, L, 2)
    return top2[..., 0] - top2[..., 1]


def neg_entropy_confidence(
    probs: torch.Tensor, x0: torch.Tensor, generators: list[torch.Generator], lengths: list[int] | None = None
) -> torch.Tensor:
    """Negative entropy sum_v p_v log p_v (nats, <= 0; 0 for a one-hot distribution): (B, L, V) -> (B, L)
    float64. Dream's ``alg="entropy"`` (``neg_entropy`` in DreamLM's ``sample_tokens``, which adds 1e-10 inside
    the log; here 0 log 0 = 0 exactly). Not the EB-sampler's commit rule (``commit_entropy``)."""
    return torch.special.xlogy(probs.double(), probs.double()).sum(-1)


def rank_desc(scores: torch.Tensor) -> torch.Tensor:
    """Rank of every entry within its row when sorted descending (0 = highest); (B, L) -> (B, L)."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    return order.argsort(dim=-1)
