"""Training objectives: masked diffusion (the dLLM) and next-token prediction (the AR twin)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from celeris.models.celeris import CelerisModel


def masked_diffusion_loss(
    model: CelerisModel,
    input_ids: torch.Tensor,
    generator: torch.Generator | None = None,
    eps: float = 1e-3,
    prefix_prob: float = 0.0,
) -> tuple[torch.Tensor, int]:
    """Masked-diffusion ELBO loss (MDLM arXiv:2406.07524 Eq. 10; LLaDA arXiv:2502.09992 Eq. 3).

    Per sequence draw t ~ U(eps, 1]; replace each token by the mask token with
    probability t; the loss is the cross-entropy at masked positions weighted by
    1/t, summed and divided by B * L, an upper bound on the negative
    log-likelihood in nats per token. The output head is computed only at masked
    positions, which is where nearly all the head's FLOPs would otherwise go.

    With ``prefix_prob`` > 0, that share of the sequences keeps a clean prefix of
    uniformly random length (1 to L - 1 tokens) that is never masked, so the
    term is the conditional bound on the rest given the prefix: LLaDA's SFT
    objective (arXiv:2502.09992 Eq. 5) with the prefix as the prompt. That is
    the situation semi-autoregressive sampling puts the model in (a clean
    prompt, then a masked answer); held-out evaluation uses ``prefix_prob=0``.

    Args:
        input_ids: (B, L) int64 clean tokens.
        generator: RNG for t and the masks (CPU generator; drawn on CPU then moved).
        prefix_prob: share of sequences with a clean prefix, in [0, 1].

    Returns:
        (scalar float32 loss, number of masked positions).
    """
    b, length = input_ids.shape
    t = torch.rand(b, 1, generator=generator) * (1 - eps) + eps  # (B, 1)
    is_masked = torch.rand(b, length, generator=generator) < t  # (B, L)
    if prefix_prob > 0:
        has_prefix = torch.rand(b, 1, generator=generator) < prefix_prob  # (B, 1)
        prefix_len = torch.randint(1, length, (b, 1), generator=generator)  # (B, 1)
        is_masked &= ~(has_prefix & (torch.arange(length)[None] < prefix_len))
    t, is_masked = t.to(input_ids.device), is_masked.to(input_ids.device)
    noisy = torch.where(is_masked, model.config.mask_token_id, input_ids)  # (B, L)
    hidden = model.hidden_states(noisy)  # (B, L, d)
    logits = model.logits(hidden[is_masked])  # (M, V)
    ce = F.cross_entropy(logits, input_ids[is_masked], reduction="none")  # (M,)
    weights = (1.0 / t).expand(b, length)[is_masked]  # (M,)
    return (ce * weights).sum() / (b * length), int(is_masked.sum())


def autoregressive_loss(
    model: CelerisModel, input_ids: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, int]:
    """Next-token cross-entropy (nats/token) for a causal model; ``generator`` is unused."""
    if not model.config.is_causal:
        raise ValueError("the autoregressive objective needs a config with is_causal=true")
    hidden = model.hidden_states(input_ids[:, :-1])  # (B, L-1, d)
    logits = model.logits(hidden)  # (B, L-1, V)
    loss = F.cross_entropy(logits.flatten(0, 1), input_ids[:, 1:].flatten())
    return loss, input_ids[:, 1:].numel()


OBJECTIVES = {"diffusion": masked_diffusion_loss, "ar": autoregressive_loss}


def hybrid_attention_mask(length: int, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """BD3-LM's vectorised layout with a token-causal clean stream (arXiv:2503.09573 Sec. 3.3; TiDAR arXiv:2511.08923).

    The sequence is ``[clean x_0 .. x_{L-1}, noisy x~_0 .. x~_{L-1}]`` (both copies at positions 0..L-1).
    A clean query i sees clean keys j <= i (the autoregressive twin's own forward); a noisy query in
    block ``p // block_size`` sees the clean keys before its block and every noisy key of its own block
    (bidirectional), never a later clean key.

    Returns:
        (2L, 2L) bool, True where the query (row) may attend to the key (column).
    """
    idx = torch.arange(length, device=device)
    block = idx // block_size
    clean_clean = idx[None, :] <= idx[:, None]  # (L, L) causal
    noisy_clean = idx[None, :] < (block * block_size)[:, None]  # keys before the query's block
    noisy_noisy = block[None, :] == block[:, None]
    top = torch.cat([clean_clean, torch.zeros_like(clean_clean)], dim=1)
    bottom = torch.cat([noisy_clean, noisy_noisy], dim=1)
    return torch.cat([top, bottom], dim=0)


def hybrid_noise(
    input_ids: torch.Tensor, block_size: int, full_mask_prob: float, generator: torch.Generator | None,
    mask_range: tuple[float, float] = (0.3, 0.8),
) -> torch.Tensor:
    """Per-block masks for the noisy copy: (B, L) bool, True where the token is replaced by the mask token.

    A block is fully masked with probability ``full_mask_prob`` (the drafting condition of verified
    decoding); otherwise its positions are masked i.i.d. with a rate t ~ U[mask_range] drawn per block
    (BD3-LM's clipped schedule, arXiv:2503.09573 Sec. 4; LLaDA2.0 uses U[0.3, 0.8]).
    """
    b, length = input_ids.shape
    num_blocks = -(-length // block_size)
    lo, hi = mask_range
    rate = lo + (hi - lo) * torch.rand(b, num_blocks, generator=generator)  # (B, nb)
    full = torch.rand(b, num_blocks, generator=generator) < full_mask_prob
    rate = torch.where(full, torch.ones_like(rate), rate).repeat_interleave(block_size, dim=1)[:, :length]
    return torch.rand(b, length, generator=generator) < rate


def hybrid_hidden_states(model: CelerisModel, clean: torch.Tensor, noisy: torch.Tensor, block_size: int) -> torch.Tensor:
    """Hidden states of the hybrid training layout: (B, L) clean and noisy ids -> (B, 2L, d), clean first."""
    b, length = clean.shape
    positions = torch.arange(length, device=clean.device).repeat(2).expand(b, 2 * length)
    mask = hybrid_attention_mask(length, block_size, clean.device)[None, None]  # (1, 1, 2L, 2L)
    return model.layout_hidden_states(torch.cat([clean, noisy], dim=1), positions, mask)


def hybrid_loss(
    model: CelerisModel,
    input_ids: torch.Tensor,
    generator: torch.Generator | None = None,
    block_size: int = 4,
    full_mask_prob: float = 0.5,
    return_parts: bool = False,
    ntp_weight: float = 1.0,
    certainty_weight: float = 0.0,
    certainty_temperature: float = 1.0,
):
    """Next-token loss on the clean stream plus masked-token loss on the noisy blocks (one forward pass).

    The adaptation recipe of Fast-dLLM v2 (arXiv:2509.26328: shifted logits, block-wise masks) on BD3-LM's
    layout (see ``hybrid_attention_mask``), with the next-token term of TiDAR / Set Block Decoding
    (arXiv:2511.08923, arXiv:2509.04185) that keeps the autoregressive head. Scoring is shifted as in the
    twin: the hidden state at position p scores token p + 1. A noisy slot's target x_{p+1} counts when the
    block did not show it: its noisy copy is masked, or it lies past the block's end (the block's last slot
    always drafts the first token of the next block). A fully masked block starting at s thus learns the
    drafts x_{s+1} .. x_{s+b} given x_{<s}, while the clean stream's x_s prediction is the exact
    next-token one; this is what verified decoding uses.

    Args:
        input_ids: (B, L) int64 clean tokens; the model must be causal (``is_causal``).
        block_size: noisy block length b (tokens).
        full_mask_prob: share of noisy blocks masked entirely.
        ntp_weight: weight of the next-token term; 0 on self-distillation batches (the model's own greedy
            continuations: the drafting targets, not text whose likelihood the next-token head should learn).
        certainty_weight: weight beta of dParallel's certainty-forcing term (arXiv:2509.26488 Sec. 3.3):
            the mean entropy of softmax(logits / ``certainty_temperature``) over the scored drafting slots whose
            argmax already equals the target, added to the loss; it makes drafts that are right also confident,
            so that more of them clear a confidence threshold. 0 (the default) leaves it out.

    Returns:
        (scalar float32 loss = NTP mean + masked mean, number of scored positions); with ``return_parts``
        also a dict ``{"ntp": float, "masked": float}`` (nats/token).

    Raises:
        ValueError: the model is not causal.
    """
    if not model.config.is_causal:
        raise ValueError("the hybrid objective starts from a causal model (is_causal=true)")
    b, length = input_ids.shape
    is_masked = hybrid_noise(input_ids, block_size, full_mask_prob, generator).to(input_ids.device)
    noisy = torch.where(is_masked, model.config.mask_token_id, input_ids)
    hidden = hybrid_hidden_states(model, input_ids, noisy, block_size)  # (B, 2L, d)
    clean_h, noisy_h = hidden[:, : length - 1], hidden[:, length : 2 * length - 1]  # both score x_1 .. x_{L-1}
    targets = input_ids[:, 1:]
    ntp = F.cross_entropy(model.logits(clean_h).flatten(0, 1), targets.flatten())
    # slot p scores x_{p+1}: hidden unless the block showed it (same block and unmasked)
    same_block = (torch.arange(1, length, device=input_ids.device) % block_size) != 0  # (L-1,) p+1 in p's block
    scored = is_masked[:, 1:] | ~same_block[None]  # (B, L-1)
    draft_logits = model.logits(noisy_h[scored])  # (M, V)
    masked = F.cross_entropy(draft_logits, targets[scored])
    loss = ntp_weight * ntp + masked
    parts = {"ntp": ntp.item(), "masked": masked.item()}
    if certainty_weight:
        certainty = certainty_entropy(draft_logits, targets[scored], certainty_temperature)
        loss = loss + certainty_weight * certainty
        parts["certainty"] = certainty.item()
    if return_parts:
        return loss, int(targets.numel() + scored.sum()), parts
    return loss, int(targets.numel() + scored.sum())


OBJECTIVES["hybrid"] = hybrid_loss


def certainty_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """dParallel's certainty-forcing term (arXiv:2509.26488 Sec. 3.3): mean temperature-scaled entropy, in nats,
    of the positions whose argmax already equals the target (a wrong prediction is left to the cross-entropy).

    Args:
        logits: (M, V) float scores of M drafting positions.
        targets: (M,) int64 target ids.
        temperature: T > 0; the entropy is of softmax(logits / T).

    Returns:
        Scalar float tensor; 0 (still attached to the graph) when no position is right.

    Raises:
        ValueError: ``temperature`` is not > 0.
    """
    if not temperature > 0:
        raise ValueError(f"certainty temperature must be > 0, got {temperature}")
    right = logits.argmax(dim=-1) == targets  # (M,)
    if not bool(right.any()):
        return logits.sum() * 0.0
    logp = F.log_softmax(logits[right].float() / temperature, dim=-1)  # (R, V)
    return -(logp.exp() * logp).sum(dim=-1).mean()
