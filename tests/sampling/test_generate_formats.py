"""The reference sampler (``celeris.reference.masked``) on the published LLaDA and Dream formats: every decoding
rule and CFG run, batched equals unbatched, the prefix / dual caches run and one step per block equals no cache."""

from __future__ import annotations

import pytest
import torch

from celeris.models.loader import load_any
from celeris.reference.masked import generate
from celeris.sampling.params import SamplingParams
from tests.models.conftest_formats import write_dream, write_llada

WRITERS = {"llada": write_llada, "dream": write_dream}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    WRITERS[request.param](folder, num_shards=1)
    return load_any(folder)


@pytest.mark.parametrize("overrides", [{"decoding": "fixed"}, {"decoding": "threshold", "threshold": 0.5},
                                       {"cfg_scale": 1.0}])
def test_sampler_runs(model, overrides):
    params = SamplingParams(max_tokens=8, steps=8, block_length=4, early_exit=False, seed=0, **overrides)
    out = generate(model, [[5, 6, 7, 8], [9, 10]], params)
    assert out.answer_ids.shape == (2, 8)
    assert not (out.answer_ids == model.config.mask_token_id).any()
    if overrides.get("decoding", "fixed") == "fixed":
        assert out.nfe == 8 * (2 if overrides.get("cfg_scale") else 1)


def test_batched_equals_unbatched(model):
    params = SamplingParams(max_tokens=8, steps=8, block_length=4, early_exit=False)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    both = generate(model, prompts, params).answer_ids
    for i, p in enumerate(prompts):
        assert torch.equal(generate(model, [p], params).answer_ids[0], both[i])


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_generate_with_cache_runs_and_one_step_per_block_equals_no_cache(model, cache):
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    mask_id = model.config.mask_token_id
    params = SamplingParams(max_tokens=12, steps=12, block_length=4, early_exit=False, cache=cache, seed=0)
    out = generate(model, prompts, params)  # several steps per block: window passes read the cache
    assert out.answer_ids.shape == (2, 12) and not (out.answer_ids == mask_id).any()
    assert out.nfe == 12
    guided = SamplingParams(max_tokens=8, steps=8, block_length=4, early_exit=False, cache=cache, cfg_scale=1.0)
    assert not (generate(model, prompts, guided).answer_ids == mask_id).any()
    one = SamplingParams(max_tokens=12, steps=3, block_length=4, early_exit=False, cache=cache)
    none = SamplingParams(max_tokens=12, steps=3, block_length=4, early_exit=False)
    assert torch.equal(generate(model, prompts, one).answer_ids, generate(model, prompts, none).answer_ids)
