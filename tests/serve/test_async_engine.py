"""AsyncEngine internals that the HTTP tests cannot hit deterministically (races with the engine thread)."""

from __future__ import annotations

import asyncio
import concurrent.futures

from celeris.engine import Engine
from celeris.serve.async_engine import AsyncEngine, EngineInput, RequestGroup


def test_add_after_the_submitter_cancelled_does_not_kill_the_engine_thread(serve_llm):
    """A cancelled ``submit`` cancels its admission future (asyncio.wrap_future) possibly before
    ``group.abort()`` runs; the engine thread must then drop the group instead of raising
    InvalidStateError from ``set_result`` on the cancelled future."""
    async_engine = AsyncEngine(Engine(serve_llm.model))
    params = serve_llm.default_params(max_tokens=4, steps=4)
    inputs = [EngineInput(serve_llm.tokenizer.encode("def add(a, b):"), params)]
    loop = asyncio.new_event_loop()
    try:
        group = RequestGroup(async_engine, ["req-x"], inputs, False, loop)
        async_engine._num_in_flight = len(inputs)  # what submit() counted before queueing the add
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        accepted.cancel()  # the submitter's await was cancelled; group._abort_sent is not set yet
        async_engine._add(group, accepted)
    finally:
        loop.close()
    assert accepted.cancelled()
    assert async_engine.num_in_flight == 0
    assert not async_engine.engine.has_unfinished()
    assert "req-x" not in async_engine._live
