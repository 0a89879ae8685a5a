"""Verified decoding through the engine: continuous batching with staggered arrivals, mixed with other
requests, equals each request's greedy next-token answer alone."""

from __future__ import annotations

import pytest

from celeris.config import EngineConfig
from celeris.engine.engine import Engine
from celeris.reference.autoregressive import generate_autoregressive
from celeris.sampling.params import SamplingParams
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def hybrid():
    return tiny_model(seed=4, is_causal=True, draft_block_size=3)


def test_engine_verified_equals_greedy_with_staggered_arrivals(hybrid):
    prompts = [[5, 9, 11], [7, 8], [20, 21, 22, 23, 24, 25], [33], [40, 41, 42, 43]]
    lengths = [14, 9, 20, 6, 12]
    engine = Engine(hybrid, EngineConfig(max_num_seqs=3))
    verified = [SamplingParams(max_tokens=n, steps=n, block_length=1, decoding="verified", early_exit=False)
                for n in lengths]
    plain = SamplingParams(max_tokens=8, steps=8, block_length=1, cache="delayed", early_exit=False)
    requests, streamed = [], {}
    arrivals = {0: [0, 1], 2: [2], 3: [3, 4]}  # step -> requests that arrive then (more than max_num_seqs run)
    other = None
    step = 0
    while step < 200 and (step <= 3 or engine.has_unfinished()):
        for i in arrivals.get(step, []):
            requests.append((i, engine.add_request(prompts[i], verified[i])))
        if step == 1:
            other = engine.add_request([3, 4, 5], plain)  # a next-token request in the same steps
        for out in engine.step():
            streamed.setdefault(out.request.request_id, []).extend(out.new_token_ids)
        step += 1
    for i, request in requests:
        alone = generate_autoregressive(hybrid, [prompts[i]], verified[i]).token_ids[0]
        assert request.final_prefix(hybrid.config.eos_token_id) == alone
        assert streamed[request.request_id] == alone  # streamed pieces add up to the answer
        assert request.finish_reason in ("length", "stop") and 1 <= request.nfe <= lengths[i]
    plain_alone = generate_autoregressive(hybrid, [[3, 4, 5]], plain).token_ids[0]
    assert other.final_prefix(hybrid.config.eos_token_id) == plain_alone
    assert all(r.state is None for _, r in requests) and engine.drafter.rows == []  # every row freed


def test_engine_refuses_verified_for_a_model_that_cannot_draft(make_model):
    engine = Engine(make_model(is_causal=True))
    with pytest.raises(ValueError, match="hybrid model"):
        engine.add_request([5, 6], SamplingParams(max_tokens=4, block_length=1, decoding="verified"))


def test_engine_verified_stops_like_next_token_decoding(hybrid):
    """Early exit at end ids, stop_token_ids and ignore_eos: the same tokens and finish reasons as the
    engine's next-token decoding of the same model."""
    prompts = [[5, 9, 11], [7, 8], [20, 21, 22, 23]]
    reasons = {}
    for name, extra in (("ends", {}), ("stop ids", {"stop_token_ids": [9, 14, 23]}), ("ignore", {"ignore_eos": True})):
        got = []
        for decoding in ("verified", "fixed"):
            engine = Engine(hybrid, EngineConfig(max_num_seqs=3), end_ids=[hybrid.config.eos_token_id, 31, 8])
            params = SamplingParams(max_tokens=24, steps=24, block_length=1, cache="delayed", decoding=decoding,
                                    **extra)
            reqs = [engine.add_request(p, params) for p in prompts]
            while engine.has_unfinished():
                engine.step()
            got.append([(r.final_prefix(hybrid.config.eos_token_id), r.finish_reason) for r in reqs])
        assert got[0] == got[1], name
        reasons[name] = [reason for _, reason in got[0]]
    assert reasons == {"ends": ["stop", "stop", "length"], "stop ids": ["stop", "stop", "stop"],
                       "ignore": ["length", "length", "length"]}


def test_engine_refuses_a_verified_request_longer_than_the_context(hybrid):
    engine = Engine(hybrid)
    with pytest.raises(ValueError, match="context window"):
        engine.add_request([5] * 100, SamplingParams(max_tokens=40, block_length=1, decoding="verified"))
