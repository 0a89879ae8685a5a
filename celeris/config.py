"""EngineConfig: settings of one engine instance (device, batching budgets, queue)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    """Engine-wide settings.

    Attributes:
        max_num_seqs: most requests denoised together in one forward pass.
        max_num_batched_tokens: most canvas tokens (batch rows x padded length,
            CFG rows included) one forward pass may process.
        max_waiting: most requests queued before ``add_request`` raises QueueFullError.
        device: "cpu", "cuda", ...; None picks CUDA when available.
    """

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 16384
    max_waiting: int = 256
    device: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
