"""What a sampler returns, and the canvas it starts from: shared by every reference sampler.

``GenerationOutput`` is the result of the masked-diffusion (``celeris.reference.masked``), block-diffusion
(``celeris.reference.block.generate_block``) and autoregressive (``celeris.reference.autoregressive``) samplers;
``build_canvas`` lays out prompt, masked answer and suffix; ``cut_at_eos`` and ``answer_done`` read an answer's end.
A leaf of ``celeris.sampling``: it imports nothing of Celeris, so a sampler that dispatches to another never needs
the other's file for its result type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class GenerationOutput:
    """Result of one batched sampler call.

    Attributes:
        answer_ids: (B, max_tokens) int64 final canvas of the answer span
            (positions never reached by early exit hold the mask id).
        token_ids: per row, the answer cut before the first end-of-text token.
        nfe: forward passes of the model (a CFG step counts as 2).
        steps: denoising steps run.
        ttft_s: per row, seconds from the call's start until answer
            position 0 was final (time to first token), or None.
        seconds: wall time of the call.
    """

    answer_ids: torch.Tensor
    token_ids: list[list[int]]
    nfe: int
    steps: int
    ttft_s: list[float | None] = field(default_factory=list)
    seconds: float = 0.0


def build_canvas(
    prompt_ids: list[list[int]],
    max_tokens: int,
    mask_id: int,
    pad_id: int,
    suffix_ids: list[list[int]] | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Lay out [left padding | prompt | masked answer | suffix | right padding] for each row.

    Returns:
        canvas (B, T) int64, attention_mask (B, T) bool (False on padding),
        is_prompt (B, T) bool (prompt and suffix tokens, masked out by CFG's
        unconditional pass), and the answer's start column.
    """
    b = len(prompt_ids)
    suffix_ids = suffix_ids or [[] for _ in range(b)]
    prompt_len = max(len(p) for p in prompt_ids)
    suffix_len = max(len(s) for s in suffix_ids)
    total = prompt_len + max_tokens + suffix_len
    canvas = torch.full((b, total), pad_id, dtype=torch.long)
    attn = torch.zeros((b, total), dtype=torch.bool)
    for i, (p, s) in enumerate(zip(prompt_ids, suffix_ids, strict=True)):
        canvas[i, prompt_len - len(p) : prompt_len] = torch.tensor(p, dtype=torch.long)
        canvas[i, prompt_len : prompt_len + max_tokens] = mask_id
        canvas[i, prompt_len + max_tokens : prompt_len + max_tokens + len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, prompt_len - len(p) : prompt_len + max_tokens + len(s)] = True
    is_prompt = attn.clone()
    is_prompt[:, prompt_len : prompt_len + max_tokens] = False
    return canvas.to(device), attn.to(device), is_prompt.to(device), prompt_len


def cut_at_eos(answer: torch.Tensor, eos_id: int, mask_id: int) -> list[list[int]]:
    """Rows of (B, N) answer ids cut before the first end-of-text (and any never-filled mask)."""
    rows = []
    for row in answer.tolist():
        for stop_id in (eos_id, mask_id):
            if stop_id in row:
                row = row[: row.index(stop_id)]
        rows.append(row)
    return rows


def answer_done(answer: torch.Tensor, eos_id: int, mask_id: int) -> torch.Tensor:
    """(B, N) -> (B,) bool: the answer holds an end-of-text token and nothing before it is masked."""
    is_eos = answer == eos_id
    first_eos = torch.where(is_eos.any(-1), is_eos.long().argmax(-1), answer.shape[1])  # (B,)
    cols = torch.arange(answer.shape[1], device=answer.device)
    masked_before = ((answer == mask_id) & (cols[None] < first_eos[:, None])).any(-1)
    return is_eos.any(-1) & ~masked_before
