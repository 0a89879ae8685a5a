"""Scheduler (``celeris.engine.scheduler``): sequence and token budgets per step; the waiting-queue limit."""

from __future__ import annotations

import pytest

from celeris.config import EngineConfig
from celeris.engine import Engine, QueueFullError, RequestStatus
from celeris.sampling.params import SamplingParams
from tests.conftest import tiny_model
from tests.engine.test_engine import PROMPTS


def test_scheduler_respects_sequence_and_token_budgets():
    model = tiny_model()
    params = SamplingParams(max_tokens=8, steps=8, block_length=8, early_exit=False)
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=10_000))
    requests = [engine.add_request(PROMPTS[0], params) for _ in range(5)]
    outputs = engine.step()
    assert len(outputs) == 2 and sum(r.status is RequestStatus.RUNNING for r in requests) == 2
    # token budget: each canvas is 7 + 8 = 15 tokens; 2 rows = 30 > 20 lets only one run at a time
    engine = Engine(model, EngineConfig(max_num_seqs=8, max_num_batched_tokens=20))
    for _ in range(3):
        engine.add_request(PROMPTS[0], params)
    assert len(engine.step()) == 1


def test_queue_limit_counts_free_slots_and_aborts_free_places():
    engine = Engine(tiny_model(), EngineConfig(max_num_seqs=1, max_waiting=2))
    params = SamplingParams(max_tokens=4, steps=4, block_length=4)
    for i in range(3):  # one takes the free running slot at the next step, two wait
        engine.add_request([5, 6], params, request_id=f"r{i}")
    with pytest.raises(QueueFullError):
        engine.add_request([5, 6], params)
    assert engine.abort("r2")  # an aborted waiting request gives its place back before any step
    engine.add_request([5, 6], params, request_id="r3")
