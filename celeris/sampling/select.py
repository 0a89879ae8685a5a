"""Per-step token choice and commit rules for masked diffusion.

Every function is vectorised over the batch; shapes use B (batch), L (positions
of the block being denoised) and V (vocabulary).
"""

from __future__ import annotations

from collections.abc import Callable

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


def sample_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, generators: list[torch.Generator],
    lengths: list[int] | None = None,
) -> torch.Tensor:
    """Gumbel-max sampling in float64 (arXiv:2409.02908: low-precision noise hurts quality).

    argmax(logits / T + g), g = -log(-log U), is an exact sample from softmax(logits / T);
    rows with T = 0 take argmax(logits).

    Args:
        logits: (B, L, V) float32. temperature: (B,) float.
        lengths: each row's own block width (<= L; ``uniform``), None: all L.

    Returns:
        (B, L) int64 token ids.
    """
    greedy = logits.argmax(-1)  # (B, L)
    if not bool((temperature > 0).any()):
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


# remasking name -> confidence; Dream's ``maskgit_plus`` is ``low_confidence``.
CONFIDENCE: dict[str, Callable[..., torch.Tensor]] = {
    "low_confidence": low_confidence,
    "random": random_confidence,
    "margin": margin_confidence,
    "entropy": neg_entropy_confidence,
}


def rank_desc(scores: torch.Tensor) -> torch.Tensor:
    """Rank of every entry within its row when sorted descending (0 = highest); (B, L) -> (B, L)."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    return order.argsort(dim=-1)


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


COMMIT_RULES: dict[str, Callable[..., torch.Tensor]] = {
    "fixed": commit_fixed,
    "threshold": commit_threshold,
    "factor": commit_factor,
    "entropy": commit_entropy,
    # SDAR's names (arXiv:2510.06303; JetEngine / LMDeploy ``remasking_strategy``): ``low_confidence_static``
    # is LLaDA's fixed count of the most confident positions
    "low_confidence_static": commit_fixed,
    "low_confidence_dynamic": commit_low_confidence_dynamic,
    "sequential": commit_sequential,
}
