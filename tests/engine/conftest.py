"""Fixtures shared by the engine tests (a test file's own ``hybrid`` fixture overrides this one)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def hybrid():
    """A tiny Celeris hybrid model (causal, draft blocks of 4), float64: its block-diffusion and verified modes."""
    from celeris.models.celeris import CelerisConfig, CelerisModel

    torch.manual_seed(0)
    model = CelerisModel(CelerisConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                                       max_position_embeddings=128, is_causal=True, draft_block_size=4))
    model.init_weights(0.5)
    return model.double().eval()
