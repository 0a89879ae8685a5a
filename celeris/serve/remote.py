"""RemoteEngine: what ``OpenAIServing`` needs of an ``AsyncEngine``, served by engine replicas elsewhere.

The serving layer talks to its engine through four things: ``submit(inputs)`` admits a group of
requests all or none (raising ``QueueFullError`` / ``ValueError`` / ``EngineDeadError`` before any
work, so the route can still answer 429 / 400 / 503), the group's ``events`` queue yields one
``StepEvent`` per request and step, ``group.abort()`` stops the work, and ``max_in_flight`` /
``is_running`` / ``num_in_flight`` / ``seconds_without_progress()`` feed validation, ``/health`` and
the drain. ``RemoteEngine`` gives the same four over a *stream* function: a call that returns an
async iterator whose first item says whether the replica admitted the group, and whose later items
are lists of ``StepEvent`` (``celeris.serve.ray`` passes a Ray Serve deployment handle streaming
call; the tests can pass anything with that shape). So no HTTP logic exists twice: validation,
errors, streaming, limits and metrics stay in ``serving`` and ``app``.

Failures of the replica (its process died, the handle could not reach it):

* before admission, the group is sent once more (the router picks a replica again; a dead one is
  dropped from its set), then ``EngineDeadError`` (503);
* after admission, a non-streamed request (``retryable``: its events are held back until every
  choice finished, so nothing has reached the client) is sent once more, from scratch;
* otherwise the group's ``events`` raises ``APIError`` 503 ``replica_unavailable`` with
  ``Retry-After``: a JSON 503 for a plain request, an error event and ``data: [DONE]`` for a stream.

A replica that is overloaded answers ``("refused", "queue_full", ...)`` and a router whose queue is
full raises Ray Serve's ``BackPressureError``: both become ``QueueFullError`` (429 + ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable

from celeris.engine import QueueFullError
from celeris.engine.engine import EngineStats
from celeris.serve.async_engine import EngineDeadError, EngineInput, StepEvent
from celeris.serve.protocol import APIError

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
ACCEPTED = "accepted"  # first item of a replica's stream: ("accepted", replica id)
REFUSED = "refused"  # or ("refused", reason, message), reason one of REFUSALS
REFUSALS = {"queue_full": QueueFullError, "invalid": ValueError, "engine_dead": EngineDeadError}

# (inputs, want_canvas) -> an async iterator of the replica's items; .cancel() on it is optional
StreamCall = Callable[[list[EngineInput], bool], AsyncIterator]


def is_backpressure(exc: BaseException) -> bool:
    """True for Ray Serve's ``BackPressureError`` (the router's queue of a deployment is full)."""
    return type(exc).__name__ == "BackPressureError" or any(
        type(c).__name__ == "BackPressureError" for c in (exc.__cause__, getattr(exc, "cause", None)) if c)


class RemoteEvents(asyncio.Queue):
    """The group's response channel: ``StepEvent`` items, or one ``APIError`` that ``get`` raises."""

    async def get(self) -> StepEvent:  # type: ignore[override]
        item = await super().get()
        if isinstance(item, BaseException):
            self.put_nowait(item)  # every later read fails the same way
            raise item
        return item


class _NoDrafter:
    """Stands for ``Engine`` where the serving layer reads ``engine.stats()`` (the replicas report theirs)."""

    def stats(self) -> EngineStats:
        return EngineStats()


class RemoteGroup:
    """The requests of one submission, running on one replica (see the module docstring).

    Attributes:
        inputs: what was submitted; ``events``: the response channel the serving layer reads.
        replica: the id of the replica that admitted the group (the last one, after a retry).
    """

    def __init__(self, owner: RemoteEngine, inputs: list[EngineInput], want_canvas: bool, retryable: bool) -> None:
        self.owner = owner
        self.inputs = inputs
        self.request_ids = [f"remote-{next(owner._ids)}" for _ in inputs]
        self.want_canvas = want_canvas
        self.retryable = retryable
        self.events = RemoteEvents()
        self.replica: str | None = None
        self._finished: set[int] = set()
        self._aborted: set[int] = set()
        self._task: asyncio.Task | None = None
        self._closed = False

    def abort(self, indices: list[int] | None = None) -> None:
        """Stop the group's work (any index list: the replica's stream is cancelled once every request is
        finished or aborted; until then the others run on and an aborted one's events are ignored)."""
        self._aborted.update(range(len(self.inputs)) if indices is None else indices)
        if len(self._aborted | self._finished) >= len(self.inputs) and self._task is not None:
            self._task.cancel()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self.owner._release(len(self.inputs))


class RemoteEngine:
    """An ``AsyncEngine`` look-alike whose requests run on remote engine replicas.

    Args:
        stream: starts one group on a replica (see ``StreamCall``).
        max_in_flight: most generations one replica holds (running + waiting): a request needing more
            is refused with 400 by the serving layer, as on a single server.
        on_failure: called with a code (``replica_unavailable``, ``replica_retry``) on each replica failure
            (metrics).
    """

    def __init__(self, stream: StreamCall, max_in_flight: int, on_failure: Callable[[str], None] | None = None) -> None:
        self.stream = stream
        self.max_in_flight = max_in_flight
        self.on_failure = on_failure or (lambda code: None)
        self.engine = _NoDrafter()
        self._ids = itertools.count()
        self._num_in_flight = 0
        self._progress_at = time.monotonic()
        self._running = False

    # -- what the serving layer, /health and the drain read ----------------------------------------

    def start(self) -> None:
        self._running = True

    def stop(self, timeout: float = 10.0) -> None:
        self._running = False

    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def seconds_without_progress(self) -> float:
        """Seconds since any replica sent an event while requests are in flight (0.0 when idle)."""
        return 0.0 if self._num_in_flight == 0 else time.monotonic() - self._progress_at

    def _release(self, count: int) -> None:
        self._num_in_flight -= count

    # -- submission --------------------------------------------------------------------------------

    async def submit(self, inputs: list[EngineInput], want_canvas: bool = False, retryable: bool = False) -> RemoteGroup:
        """Admit ``inputs`` on one replica, all or none, and return their group.

        Args:
            retryable: nothing of the answer is sent before it is complete (a non-streamed request), so a
                replica failure after admission may start it again on another replica.

        Raises:
            QueueFullError: the replica or the router's queue is full (429).
            ValueError: the replica's engine refused an input (400).
            EngineDeadError: no replica could take the group, after one retry (503).
        """
        if not self._running:
            raise EngineDeadError("the engine client is not running")
        group = RemoteGroup(self, inputs, want_canvas, retryable)
        if self._num_in_flight == 0:
            self._progress_at = time.monotonic()
        self._num_in_flight += len(inputs)
        try:
            iterator = await self._admit(group, retry=True)
        except BaseException:
            group._close()
            raise
        group._task = asyncio.get_running_loop().create_task(self._pump(group, iterator))
        return group

    async def _admit(self, group: RemoteGroup, retry: bool) -> AsyncIterator:
        """Start the group on a replica; returns the stream after its ``accepted`` item."""
        for attempt in range(2 if retry else 1):
            iterator = self.stream(group.inputs, group.want_canvas)
            try:
                first = await anext(iterator)
            except asyncio.CancelledError:
                _cancel(iterator)
                raise
            except Exception as exc:
                _cancel(iterator)
                if is_backpressure(exc):
                    raise QueueFullError("every engine replica is busy and the router's queue is full; retry later") \
                        from None
                self.on_failure("replica_unavailable")
                logger.warning("engine replica unavailable (attempt %d): %s: %s", attempt + 1, type(exc).__name__,
                               str(exc).splitlines()[0] if str(exc) else "")
                if attempt == 0 and retry:
                    continue
                raise EngineDeadError(f"no engine replica could take the request ({type(exc).__name__})") from None
            if first[0] == ACCEPTED:
                group.replica = first[1]
                return iterator
            _cancel(iterator)
            _, reason, message = first
            raise REFUSALS.get(reason, EngineDeadError)(message)
        raise AssertionError("unreachable")

    async def _pump(self, group: RemoteGroup, iterator: AsyncIterator) -> None:
        """Move the replica's events into ``group.events`` (held back until the end when ``retryable``)."""
        held: list[StepEvent] = []
        retried = False
        try:
            while True:
                try:
                    async for batch in iterator:
                        self._progress_at = time.monotonic()
                        for event in batch:
                            if event.finished:
                                group._finished.add(event.index)
                            if group.retryable:
                                held.append(event)
                            else:
                                group.events.put_nowait(event)
                    if len(group._finished) < len(group.inputs):
                        raise RuntimeError("the replica's stream ended before every request finished")
                    for event in held:
                        group.events.put_nowait(event)
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    _cancel(iterator)
                    logger.warning("engine replica %s failed during a request: %s: %s", group.replica,
                                   type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                    if not group.retryable or retried:
                        raise
                    retried = True
                    self.on_failure("replica_retry")
                    held.clear()
                    group._finished.clear()
                    iterator = await self._admit(group, retry=False)
        except asyncio.CancelledError:
            _cancel(iterator)
        except Exception as exc:
            self.on_failure("replica_unavailable")
            status, code = (429, "queue_full") if isinstance(exc, QueueFullError) else (503, "replica_unavailable")
            group.events.put_nowait(APIError(
                status, f"the engine replica serving this request failed ({type(exc).__name__}); retry",
                code=code, headers={"Retry-After": str(RETRY_AFTER_S)}))
        finally:
            group._close()


def _cancel(iterator: AsyncIterator) -> None:
    """Cancel a Ray Serve response stream (so the replica aborts its requests); other iterators are closed."""
    cancel = getattr(iterator, "cancel", None)
    if cancel is not None:
        with contextlib.suppress(Exception):
            cancel()
