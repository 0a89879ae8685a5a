"""An engine replica (``CelerisEngine``) driven in this process, without starting Ray: ``load`` reports the
unfinished requests of its streams (what tests/serve/test_ray_serve.py polls to kill a replica that has a
request in flight), and a stream closed right after its ``accepted`` item aborts its requests."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading

import pytest

from celeris.engine import RequestStatus
from celeris.serve.async_engine import EngineInput
from celeris.serve.remote import ACCEPTED

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")


@pytest.fixture
def replica(serve_checkpoint):
    # imported here, not at collection: celeris.serve.ray imports Ray Serve (~1.5 s in every xdist worker)
    pytest.importorskip("ray.serve")
    from celeris.serve.ray import CelerisEngine

    replica = CelerisEngine.func_or_class({"model": str(serve_checkpoint), "max_num_seqs": 1, "max_waiting": 4})
    yield replica
    replica.async_engine.stop()


def two_inputs(replica) -> list[EngineInput]:
    llm = replica.serving.llm
    params = llm.default_params(max_tokens=8, steps=8, block_length=8, temperature=0.0)
    ids, _ = llm.encode_prompt("def f(x):", params)
    return [EngineInput(prompt_ids=ids, params=params) for _ in range(2)]


async def wait_idle(replica, timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.01)):
        if replica.async_engine.num_in_flight == 0:
            return True
        await asyncio.sleep(0.01)
    return False


def test_load_lists_each_unfinished_request_with_its_committed_positions(replica):
    async def run() -> list[list[int]]:
        stream = replica.generate(two_inputs(replica))
        assert await anext(stream) == (ACCEPTED, replica.replica_id)
        pid, committed = await replica.load()
        assert pid == os.getpid() and committed == [0, 0]
        seen = []
        async for batch in stream:
            assert batch
            seen.append((await replica.load())[1])
        assert (await replica.load())[1] == []  # the stream ended: nothing left in flight
        return seen

    seen = asyncio.run(run())
    # one request runs at a time (max_num_seqs=1): the other waits with 0 committed while the first commits
    assert seen[0][0] == 0 and 0 < seen[0][1] <= 8, seen
    assert [] not in seen[:-1] and seen[-1] == [], seen
    assert all(len(s) <= 2 and s == sorted(s) and all(0 <= c <= 8 for c in s) for s in seen), seen


def test_a_stream_closed_after_its_accepted_item_aborts_its_requests(replica, monkeypatch):
    """The engine takes no step until the stream is closed, so the requests cannot finish on their own."""
    engine = replica.async_engine.engine
    gate, added = threading.Event(), []
    real_step, real_add = engine.step, engine.add_request

    def gated_step():
        gate.wait(30)
        return real_step()

    def recording_add(*args, **kwargs):
        request = real_add(*args, **kwargs)
        added.append(request)
        return request

    monkeypatch.setattr(engine, "step", gated_step)
    monkeypatch.setattr(engine, "add_request", recording_add)

    async def run() -> None:
        stream = replica.generate(two_inputs(replica))
        assert (await anext(stream))[0] == ACCEPTED
        assert replica.async_engine.num_in_flight == 2
        await stream.aclose()
        assert (await replica.load())[1] == []
        gate.set()
        assert await wait_idle(replica), "the requests of a closed stream were not aborted"

    try:
        asyncio.run(run())
    finally:
        gate.set()
    assert len(added) == 2 and all(r.status is RequestStatus.ABORTED for r in added), [r.status for r in added]
