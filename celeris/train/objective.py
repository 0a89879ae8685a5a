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
