"""KV-cache policies (``celeris.sampling.cache``): the columns each mode recomputes, and a mode added as one
``CachePolicy`` entry running through the reference sampler and the engine with the same tokens."""

from __future__ import annotations

import pytest

from celeris.config import EngineConfig
from celeris.engine import Engine
from celeris.reference.masked import generate
from celeris.sampling.cache import CACHE_MODES, CachePolicy, cache_window
from celeris.sampling.params import SamplingParams
from tests.conftest import tiny_model

BLOCKS = [(0, 4), (4, 8), (8, 12)]
START, TOTAL = 10, 30  # the answer's first canvas column; the end of what the passes see
# (block, step in block) -> columns [w0, w1) recomputed; None: a full pass
EXPECTED = {
    "none": {(0, 0): None, (0, 1): None, (1, 0): None, (1, 1): None, (2, 0): None},
    "prefix": {(0, 0): None, (0, 1): (10, 30), (1, 0): None, (1, 1): (14, 30), (2, 0): None},
    "dual": {(0, 0): None, (0, 1): (10, 14), (1, 0): None, (1, 1): (14, 18), (2, 0): None},
    "delayed": {(0, 0): None, (0, 1): (10, 14), (1, 0): (14, 18), (1, 1): (14, 18), (2, 0): (18, 22)},
    "dual_delayed": {(0, 0): None, (0, 1): (10, 14), (1, 0): (10, 30), (1, 1): (14, 18), (2, 0): (14, 30)},
}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_columns_each_mode_recomputes(mode):
    got = {(b, s): cache_window(mode, BLOCKS, b, START, TOTAL, s) for b, s in EXPECTED[mode]}
    assert got == EXPECTED[mode]


def test_refresh_every_second_block_is_a_full_pass_there():
    for mode in ("delayed", "dual_delayed"):
        assert cache_window(mode, BLOCKS, 2, START, TOTAL, 0, refresh=2) is None
        assert cache_window(mode, BLOCKS, 1, START, TOTAL, 0, refresh=2) is not None


def test_only_the_exact_modes_are_offered_to_causal_models():
    assert {name for name, policy in CACHE_MODES.items() if policy.exact_for_causal} == {"none", "delayed"}


def _block_only(blocks: list[tuple[int, int]], block_idx: int, answer_start: int, total: int, step_in_block: int,
                refresh: int) -> tuple[int, int] | None:
    """A toy mode: one prefill, then only the current block, with no rewrite of the previous block's last commits."""
    if block_idx == 0 and step_in_block == 0:
        return None
    return answer_start + blocks[block_idx][0], answer_start + blocks[block_idx][1]


@pytest.fixture
def block_only():
    CACHE_MODES["block_only"] = CachePolicy(_block_only, "prefill, then the block", exact_for_causal=False,
                                            recomputes_suffix=False)
    yield "block_only"
    del CACHE_MODES["block_only"]


def test_a_new_mode_is_one_policy_for_the_sampler_and_the_engine(block_only):
    model = tiny_model()
    prompts = [[5, 6, 7, 8, 9], [12, 13]]
    params = SamplingParams(max_tokens=12, steps=12, block_length=4, cache="block_only", early_exit=False)
    reference = generate(model, prompts, params)
    engine = Engine(model, EngineConfig(max_num_seqs=4))
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert [r.answer.tolist() for r in requests] == reference.answer_ids.tolist()
    # one pass per step, as the delayed mode it resembles; its suffix is never recomputed, so no suffix window
    delayed = generate(model, prompts, SamplingParams(max_tokens=12, steps=12, block_length=4, cache="delayed",
                                                      early_exit=False))
    assert reference.nfe == delayed.nfe == 12
    with pytest.raises(ValueError, match="suffix_window cannot be used with cache='block_only'"):
        SamplingParams(cache="block_only", suffix_window=2)
