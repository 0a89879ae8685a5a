"""Block layout and the linear transfer schedule of semi-autoregressive masked diffusion."""

from __future__ import annotations

import math

import torch


def block_plan(max_tokens: int, block_length: int, steps: int) -> tuple[list[tuple[int, int]], int]:
    """Split the answer into blocks and steps per block.

    Rounding rule (documented, never an assertion): ``block_length`` is capped at
    ``max_tokens``; there are ``ceil(max_tokens / block_length)`` blocks
    and the last one may be shorter. Each block gets
    ``ceil(steps / num_blocks)`` denoising steps, clamped to [1, block size],
    because a step must commit at least one token. The total number of forward
    passes of ``fixed`` decoding is therefore the sum over blocks of that number.

    Returns:
        ([(start, end) offsets within the answer, ...], steps per full block).
    """
    block_length = min(block_length, max_tokens)
    num_blocks = math.ceil(max_tokens / block_length)
    bounds = [(b * block_length, min((b + 1) * block_length, max_tokens)) for b in range(num_blocks)]
    return bounds, max(1, math.ceil(steps / num_blocks))


def num_transfer_tokens(num_masked: torch.Tensor, steps: int) -> torch.Tensor:
    """Linear schedule: how many tokens each step commits (LLaDA arXiv:2502.09992, App. B).

    ``num_masked`` (B,) int64 masked tokens in the block are spread over
    ``steps`` steps as evenly as possible, the remainder going to the first steps.

    Returns:
        (B, steps) int64; each row sums to ``num_masked``.
    """
    base = num_masked[:, None] // steps  # (B, 1)
    remainder = num_masked[:, None] % steps  # (B, 1)
    step_idx = torch.arange(steps, device=num_masked.device)[None, :]  # (1, S)
    return base + (step_idx < remainder).long()  # (B, S)
