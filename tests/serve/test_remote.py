"""RemoteEngine (the serving layer's engine seam for Ray Serve replicas) without Ray: a fake replica stream
drives a real local AsyncEngine, and can fail at admission or after a number of steps."""

from __future__ import annotations

import asyncio

import pytest

from celeris.engine import QueueFullError
from celeris.serve.protocol import APIError, CompletionRequest
from celeris.serve.remote import ACCEPTED, REFUSED, RemoteEngine, is_backpressure
from celeris.serve.serving import OpenAIServing
from tests.serve.conftest import MODEL_NAME, make_serving


class ReplicaDied(Exception):
    """Stands for Ray's ActorDiedError."""


class BackPressureError(Exception):
    """Same name as Ray Serve's router error."""


class FakeReplicas:
    """``StreamCall`` over one local engine: the n-th call can die before admission, or after ``die_after``
    batches of events."""

    def __init__(self, local: OpenAIServing, die_at_admission: set[int] = frozenset(),
                 die_after: dict[int, int] | None = None, refuse: str | None = None) -> None:
        self.local = local
        self.calls = 0
        self.die_at_admission = die_at_admission
        self.die_after = die_after or {}
        self.refuse = refuse

    def __call__(self, inputs, want_canvas):
        call = self.calls
        self.calls += 1
        return self._stream(call, inputs, want_canvas)

    async def _stream(self, call, inputs, want_canvas):
        if call in self.die_at_admission:
            raise ReplicaDied("the actor died unexpectedly")
        if self.refuse == "backpressure":
            raise BackPressureError("queue full")
        if self.refuse:
            yield (REFUSED, self.refuse, f"refused: {self.refuse}")
            return
        group = await self.local.async_engine.submit(inputs, want_canvas)
        yield (ACCEPTED, f"replica-{call}")
        remaining, sent = len(inputs), 0
        try:
            while remaining:
                if sent == self.die_after.get(call, -1):
                    raise ReplicaDied("the actor died unexpectedly")
                event = await group.events.get()
                remaining -= event.finished
                sent += 1
                yield [event]
        finally:
            if remaining:
                group.abort()


@pytest.fixture
def local(serve_llm):
    serving = make_serving(serve_llm)
    serving.start()
    yield serving
    serving.stop()


def front(serve_llm, replicas: FakeReplicas) -> OpenAIServing:
    serving = OpenAIServing(serve_llm, async_engine=RemoteEngine(replicas, max_in_flight=12),
                            served_model_name=MODEL_NAME)
    serving.start()
    return serving


BODY = {"prompt": "def fibonacci(n):", "max_tokens": 16, "seed": 4, "temperature": 1.0}


def test_remote_answer_equals_local_answer(serve_llm, local):
    expected = local.run_sync("/v1/completions", BODY)["choices"][0]["text"]
    serving = front(serve_llm, FakeReplicas(local))
    assert serving.run_sync("/v1/completions", BODY)["choices"][0]["text"] == expected
    assert serving.async_engine.num_in_flight == 0


def test_failures_before_admission_and_of_a_plain_request_are_retried_once(serve_llm, local):
    expected = local.run_sync("/v1/completions", BODY)["choices"][0]["text"]
    replicas = FakeReplicas(local, die_at_admission={0})
    assert front(serve_llm, replicas).run_sync("/v1/completions", BODY)["choices"][0]["text"] == expected
    assert replicas.calls == 2
    replicas = FakeReplicas(local, die_after={0: 2})  # dies mid-answer: nothing was sent, so it starts again
    assert front(serve_llm, replicas).run_sync("/v1/completions", BODY)["choices"][0]["text"] == expected
    assert replicas.calls == 2


def test_a_second_failure_is_503_with_retry_after(serve_llm, local):
    with pytest.raises(APIError) as info:
        front(serve_llm, FakeReplicas(local, die_at_admission={0, 1})).run_sync("/v1/completions", BODY)
    assert info.value.status_code == 503 and info.value.code == "engine_unavailable"
    serving = front(serve_llm, FakeReplicas(local, die_after={0: 1, 1: 1}))
    with pytest.raises(APIError) as info:
        serving.run_sync("/v1/completions", BODY)
    assert info.value.status_code == 503 and info.value.code == "replica_unavailable"
    assert info.value.headers["Retry-After"] == "1"
    assert serving.async_engine.num_in_flight == 0


def test_a_running_stream_ends_with_an_error_event(serve_llm, local):
    replicas = FakeReplicas(local, die_after={0: 2})
    serving = front(serve_llm, replicas)

    async def run() -> tuple[list, Exception | None]:
        chunks = []
        stream = await serving.create_completion(CompletionRequest(**BODY, stream=True))
        try:
            async for chunk in stream:
                chunks.append(chunk)
        except APIError as exc:
            return chunks, exc
        return chunks, None

    chunks, error = asyncio.run(run())
    assert error is not None and error.code == "replica_unavailable" and replicas.calls == 1  # no retry of a stream
    assert serving.async_engine.num_in_flight == 0


@pytest.mark.parametrize(("refuse", "status"), [("queue_full", 429), ("backpressure", 429), ("invalid", 400),
                                                ("engine_dead", 503)])
def test_refusals_map_to_status_codes(serve_llm, local, refuse, status):
    with pytest.raises(APIError) as info:
        front(serve_llm, FakeReplicas(local, refuse=refuse)).run_sync("/v1/completions", BODY)
    assert info.value.status_code == status
    if status == 429:
        assert info.value.headers["Retry-After"] == "1"


def test_is_backpressure_sees_wrapped_errors():
    wrapped = RuntimeError("wrapped")
    wrapped.__cause__ = BackPressureError()
    assert is_backpressure(BackPressureError()) and is_backpressure(wrapped)
    assert not is_backpressure(QueueFullError("x"))
