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


def test_a_requests_block_schedule_is_the_linear_schedule():
    """``Request`` keeps its block's schedule in Python ints (a step reads it per request); it must equal
    ``num_transfer_tokens`` (LLaDA's linear schedule) for blocks of one column and of many, a partly filled
    block included."""
    import torch

    from celeris.engine.request import Request
    from celeris.sampling.params import SamplingParams
    from celeris.sampling.schedule import num_transfer_tokens

    for max_tokens, block_length, steps in ((1, 1, 1), (7, 7, 3), (16, 8, 6), (10, 4, 10)):
        r = Request("r", [5, 6], SamplingParams(max_tokens=max_tokens, block_length=block_length, steps=steps), 1)
        s, e = r.block_span
        want = num_transfer_tokens(torch.tensor([e - s]), min(r.steps_per_block, e - s))[0].tolist()
        assert r.schedule == want
        assert r.tokens_this_step() == want[0]
    r = Request("r", [5, 6], SamplingParams(max_tokens=8, block_length=8, steps=3), 1)
    r.canvas[r.answer_start : r.answer_start + 3] = 9  # three of the block's eight columns filled
    r._new_block()
    assert r.schedule == num_transfer_tokens(torch.tensor([5]), 3)[0].tolist() == [2, 2, 1]
