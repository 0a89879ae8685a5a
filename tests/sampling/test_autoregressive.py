"""The cached autoregressive decoder against full recomputation, on a tiny causal model."""

import pytest
import torch

from celeris.models.celeris import CelerisConfig, CelerisModel
from celeris.reference.autoregressive import generate_autoregressive
from celeris.sampling.params import SamplingParams


def tiny_causal(seed: int = 0) -> CelerisModel:
    torch.manual_seed(seed)
    cfg = CelerisConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                        max_position_embeddings=64, mask_token_id=1, eos_token_id=0, pad_token_id=2, is_causal=True)
    model = CelerisModel(cfg)
    model.init_weights(std=0.5)  # large weights: confident, varied predictions
    return model.eval()


def slow_greedy(model: CelerisModel, prompt: list[int], n: int) -> list[int]:
    """Obviously-correct reference: recompute the whole sequence, append the argmax."""
    ids = list(prompt)
    for _ in range(n):
        logits = model.logits(model.hidden_states(torch.tensor([ids]))[0, -1])  # next token from the last state
        logits[[1, 2]] = float("-inf")
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_cached_greedy_matches_full_recompute_and_batching():
    model = tiny_causal()
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    params = SamplingParams(max_tokens=12, early_exit=False)
    batched = generate_autoregressive(model, prompts, params)
    uncached = generate_autoregressive(model, prompts, params, use_cache=False)
    assert torch.equal(batched.answer_ids, uncached.answer_ids)
    for i, p in enumerate(prompts):
        assert batched.answer_ids[i].tolist() == slow_greedy(model, p, 12)
    assert batched.nfe == 12


def test_seeded_sampling_is_reproducible_and_requires_causal_model():
    model = tiny_causal()
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    a = generate_autoregressive(model, [[5, 6, 7]], params).answer_ids
    b = generate_autoregressive(model, [[5, 6, 7]], params).answer_ids
    assert torch.equal(a, b)
    model.config.is_causal = False
    with pytest.raises(ValueError, match="causal"):
        generate_autoregressive(model, [[5, 6, 7]], params)
