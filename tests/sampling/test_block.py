"""SDAR's commit rules, the block plan, the settings a block model refuses, and the reference block sampler."""

from __future__ import annotations

import pytest
import torch

from celeris.models.contract import CONTRACTS
from celeris.sampling.block import block_units, check_block_support, padded_length
from celeris.sampling.params import SamplingParams
from celeris.sampling.rules import COMMIT_RULES
from celeris.sampling.select import NEG_INF

CONF = torch.tensor([[0.95, NEG_INF, 0.5, 0.97, 0.2], [0.3, 0.4, NEG_INF, 0.1, 0.2]], dtype=torch.float64)


def test_low_confidence_dynamic_commits_above_threshold_else_the_static_count():
    rule = COMMIT_RULES["low_confidence_dynamic"].fn
    # row 0: two above 0.9 >= count 2 -> exactly those; row 1: none above -> the 2 most confident, not one
    chosen = rule(CONF, num_tokens=torch.tensor([2, 2]), threshold=0.9)
    assert chosen.tolist() == [[True, False, False, True, False], [True, True, False, False, False]]
    # row 0 with count 3 > the two above: falls back to the three most confident
    chosen = rule(CONF, num_tokens=torch.tensor([3, 1]), threshold=0.9)
    assert chosen[0].tolist() == [True, False, True, True, False] and chosen[1].sum() == 1


def test_sequential_commits_left_to_right_from_the_first_masked_position():
    conf = torch.tensor([[NEG_INF, 0.1, NEG_INF, 0.9, 0.8]], dtype=torch.float64)
    chosen = COMMIT_RULES["sequential"].fn(conf, num_tokens=torch.tensor([3]))
    assert chosen.tolist() == [[False, True, False, True, False]]  # columns 1..3, masked ones only


def test_low_confidence_static_is_the_fixed_count():
    assert COMMIT_RULES["low_confidence_static"].fn(CONF, num_tokens=torch.tensor([1, 1])).sum().item() == 2


def test_block_units_align_to_multiples_of_the_block_size():
    sdar = CONTRACTS["sdar"]
    # prompt of 6, answer of 7: the prompt's partial block [4, 8) is denoised with answer columns 6, 7; the last
    # block is whole (columns 13..15 are padding, attended and denoised, as SDAR's generate.py does)
    assert block_units(6, 7, sdar, 4) == [(4, 8, 6, 8), (8, 12, 8, 12), (12, 16, 12, 16)]
    assert padded_length(6, 7, sdar) == 16 and padded_length(6, 7, sdar, context_length=14) == 14
    fast = CONTRACTS["fast_dllm_v2"].with_block_size(8)
    assert block_units(3, 10, fast, 4) == [(0, 8, 3, 4), (0, 8, 4, 8), (8, 16, 8, 12), (8, 16, 12, 16)]


@pytest.mark.parametrize("setting, word", [
    ({"block_length": 3}, "block_length 3 must divide this model's trained block size 4"),
    ({"cache": "dual"}, "cache"), ({"suffix_window": 4}, "suffix_window"), ({"cfg_scale": 1.0}, "cfg_scale"),
    ({"decoding": "verified"}, "decoding"),
])
def test_settings_that_do_not_apply_are_refused_naming_the_parameter(setting, word):
    params = SamplingParams(**({"block_length": 4} | setting))
    with pytest.raises(ValueError) as info:
        check_block_support(CONTRACTS["sdar"], params)
    assert str(info.value).startswith(word.split()[0]) and word in str(info.value)


def test_threshold_applies_to_low_confidence_dynamic():
    assert SamplingParams(decoding="low_confidence_dynamic", threshold=0.5).threshold == 0.5
    with pytest.raises(ValueError, match="threshold applies to"):
        SamplingParams(decoding="sequential", threshold=0.5)


def test_a_block_length_the_caller_gives_counts_even_at_the_generic_default(tmp_path):
    """Issue 28 item 4's fault in the block path: a block_length of 32 the caller gave was replaced by the
    contract's sub-block as if it were SamplingParams' unset default; only the default is adapted now."""
    from celeris.llm import LLM
    from celeris.sampling.block import with_block_defaults
    from tests.models.conftest_block_formats import write_sdar

    write_sdar(tmp_path)
    llm = LLM(tmp_path, device="cpu")
    assert with_block_defaults(llm.model, SamplingParams(max_tokens=8)).block_length == 4  # not given: the model's
    assert len(llm.generate("x", SamplingParams(max_tokens=3))[0].token_ids) <= 3
    for given in (SamplingParams(max_tokens=8, block_length=32), llm.default_params(max_tokens=8, block_length=32)):
        with pytest.raises(ValueError, match="block_length 32 must divide this model's trained block size 4"):
            llm.generate("x", given)
