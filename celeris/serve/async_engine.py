"""AsyncEngine: one background thread owns the (synchronous, not thread-safe) Engine; asyncio code
talks to it through queues.

The shape follows the text-generation-inference router: admission first (a bounded count of
requests in flight, answered at once, so a full server says 429 without waiting for a step), then a
command queue the engine thread drains at step boundaries (add / abort), and for every submitted
group of requests one response channel (an ``asyncio.Queue`` on the submitter's event loop) that
receives a ``StepEvent`` after every step each request takes. A group is what one HTTP request
needs: ``n`` choices of each of its prompts, admitted all or none.

Nothing here decodes text; the serving layer turns events into OpenAI responses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from celeris.engine import Engine, QueueFullError
from celeris.sampling.logprobs import TokenLogprob
from celeris.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.1  # how often an idle engine thread wakes to check for shutdown


class EngineDeadError(RuntimeError):
    """The engine thread is not running (never started, stopped, or crashed)."""


@dataclass(slots=True)
class EngineInput:
    """One generation to run: token ids in, settings (with this choice's seed)."""

    prompt_ids: list[int]
    params: SamplingParams
    suffix_ids: list[int] = field(default_factory=list)
    score_only: bool = False  # score the prompt and finish with no answer (``Engine.add_request``)


@dataclass(slots=True)
class StepEvent:
    """What one engine step did for one request of a group (a snapshot: safe to read on any thread).

    Attributes:
        index: position of the request in its group's inputs.
        new_token_ids: answer tokens that became final this step (see ``Engine.step``).
        finished: the request is done; no more events follow for it.
        finish_reason: "stop" (end-of-text), "length", "abort" or "error" once finished.
        nfe: forward passes the request took part in so far.
        steps: denoising steps the request took so far.
        num_committed: answer positions committed so far.
        canvas_ids: the whole answer span (mask id where still masked), only for groups
            submitted with ``want_canvas``.
        draft_ids: under verified decoding, the drafts the next pass checks (answer positions right after
            the committed ones), only with ``want_canvas``.
        error: what went wrong when ``finish_reason == "error"``.
        error_code: machine-readable code of that error (``"no_progress"``: a denoising step committed
            nothing; ``"engine_error"``: the step itself failed).
        logprobs: with ``params.logprobs``, one entry per id of ``new_token_ids`` (``celeris.sampling.logprobs``).
        prompt_logprobs: with ``params.prompt_logprobs``, the prompt's entries (None for its first token), in the
            request's first event after they were computed.
        end_logprob: with ``params.logprobs``, in the last event of an answer an end id ended: that token's entry.
    """

    index: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    nfe: int = 0
    drafter_passes: int = 0  # a DFlash drafter's passes for the request so far
    steps: int = 0
    num_committed: int = 0
    canvas_ids: list[int] | None = None
    draft_ids: list[int] | None = None
    error: str | None = None
    error_code: str | None = None
    logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    end_logprob: TokenLogprob | None = None


class RequestGroup:
    """Handle on the requests of one submission; ``events`` is its response channel.

    Only the engine thread mutates ``_unfinished``; ``abort`` may be called from any thread, any
    number of times.
    """

    def __init__(self, owner: AsyncEngine, request_ids: list[str], inputs: list[EngineInput], want_canvas: bool,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.owner = owner
        self.request_ids = request_ids
        self.inputs = inputs
        self.want_canvas = want_canvas
        self.loop = loop
        self.events: asyncio.Queue[StepEvent] = asyncio.Queue()
        self._unfinished = set(range(len(request_ids)))
        self._abort_sent = False
        self._prompt_scores_sent: set[int] = set()  # engine thread: requests whose prompt_logprobs went out

    def abort(self, indices: list[int] | None = None) -> None:
        """Abort the group's requests (or those at ``indices``) at the next step boundary."""
        if indices is None:
            if self._abort_sent:
                return
            self._abort_sent = True
            indices = list(range(len(self.request_ids)))
        self.owner._commands.put(("abort", self, list(indices)))

    def _deliver(self, event: StepEvent) -> None:
        """Engine thread: hand an event to the submitter's loop (dropped when that loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop was closed: nobody listens any more, so stop the work
            if not self._abort_sent:
                self._abort_sent = True
                self.owner._commands.put(("abort", self, list(range(len(self.request_ids)))))


class AsyncEngine:
    """Runs ``engine.step()`` on a dedicated thread while requests are unfinished.

    Args:
        engine: the engine; after ``start()`` only the engine thread calls it.
        max_in_flight: most requests admitted and not yet finished (running + waiting); a
            submission that would exceed it raises QueueFullError at once. Default: the
            engine's ``max_num_seqs + max_waiting``.
        on_stats: called on the engine thread after every step with (num_waiting, num_running).
    """

    def __init__(self, engine: Engine, max_in_flight: int | None = None,
                 on_stats: Callable[[int, int], None] | None = None) -> None:
        self.engine = engine
        self.max_in_flight = max_in_flight or engine.config.max_num_seqs + engine.config.max_waiting
        self.on_stats = on_stats
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, tuple[RequestGroup, int]] = {}  # engine thread only
        self._lock = threading.Lock()
        self._num_in_flight = 0
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._progress_at = time.monotonic()  # the last completed step, or when work arrived at an idle engine
        self.error: BaseException | None = None  # what killed the engine thread, if anything

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="celeris-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and join the engine thread."""
        self._stopping.set()
        self._commands.put(("stop", None, None))
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def seconds_without_progress(self) -> float:
        """Seconds since the last completed engine step while requests are in flight (0.0 when idle):
        how long the engine has been stuck, for ``/health``."""
        if self._num_in_flight == 0:
            return 0.0
        return time.monotonic() - self._progress_at

    # -- submission (any event loop) -----------------------------------------------------------

    async def submit(self, inputs: list[EngineInput], want_canvas: bool = False, retryable: bool = False) -> RequestGroup:
        """Admit ``inputs`` all or none and return their group.

        ``retryable`` (nothing is sent before the answer is complete) matters only to an engine in another
        process (``celeris.serve.remote.RemoteEngine``); a local engine cannot lose a request to a failure.

        Raises:
            QueueFullError: admitting them would pass ``max_in_flight``, or the engine's waiting
                queue is full (retry later).
            ValueError: the engine refused an input (e.g. an empty prompt).
            EngineDeadError: the engine thread is not running.
        """
        if not self.is_running:
            raise EngineDeadError(f"the engine thread is not running ({self.error or 'not started'})")
        with self._lock:
            if self._num_in_flight + len(inputs) > self.max_in_flight:
                raise QueueFullError(
                    f"the server is at capacity ({self._num_in_flight} requests in flight, at most "
                    f"{self.max_in_flight}); retry later"
                )
            if self._num_in_flight == 0:
                self._progress_at = time.monotonic()  # an idle engine has not stalled
            self._num_in_flight += len(inputs)
        ids = [f"req-{next(self._ids)}" for _ in inputs]
        group = RequestGroup(self, ids, inputs, want_canvas, asyncio.get_running_loop())
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", group, accepted))
        if not self.is_running:  # the thread ended between the check above and the put
            self._refuse_pending(f"the engine thread is not running ({self.error or 'stopped'})")
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            group.abort()
            raise
        return group

    # -- engine thread -------------------------------------------------------------------------

    def _release(self, count: int) -> None:
        with self._lock:
            self._num_in_flight -= count

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if self._stopping.is_set() or not self.engine.has_unfinished():
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # a failed step fails its requests, not the server
                    self._progress_at = time.monotonic()
                    logger.exception("engine step failed")
                    self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                    continue
                self._progress_at = time.monotonic()
                for out in outputs:
                    self._emit(out.request.request_id, out.new_token_ids, out.finished, out.request)
                self._report_stats()
        except BaseException as exc:  # pragma: no cover - the thread must never die silently
            self.error = exc
            logger.exception("engine thread crashed")
        finally:
            message = "the server is shutting down" if self.error is None else f"engine crashed: {self.error}"
            self._fail_all(message)
            self._refuse_pending(message)

    def _refuse_pending(self, message: str) -> None:
        """After the loop ended: fail submissions still queued so no submitter waits forever."""
        while True:
            try:
                kind, group, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._release(len(group.inputs))
                if arg.set_running_or_notify_cancel():  # False: the submitter already gave up (cancelled)
                    arg.set_exception(EngineDeadError(message))

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, group, arg = command
            if kind == "add":
                self._add(group, arg)
            elif kind == "abort":
                self._abort(group, arg)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, group: RequestGroup, accepted: concurrent.futures.Future) -> None:
        # The submitter gave up before admission. Its cancelled await may already have cancelled
        # ``accepted`` (asyncio.wrap_future does) before ``abort`` set the flag: setting a result on a
        # cancelled future raises InvalidStateError, which would kill this thread. Once
        # set_running_or_notify_cancel() returns True the future can no longer be cancelled.
        if group._abort_sent or not accepted.set_running_or_notify_cancel():
            self._release(len(group.inputs))
            accepted.cancel()
            return
        added: list[str] = []
        try:
            for rid, inp in zip(group.request_ids, group.inputs, strict=True):
                self.engine.add_request(inp.prompt_ids, inp.params, inp.suffix_ids, request_id=rid,
                                        score_only=inp.score_only)
                added.append(rid)
        except (QueueFullError, ValueError) as exc:
            for rid in added:
                self.engine.abort(rid)
            self._release(len(group.inputs))
            accepted.set_exception(exc)
            return
        for i, rid in enumerate(group.request_ids):
            self._live[rid] = (group, i)
        accepted.set_result(None)
        self._report_stats()

    def _abort(self, group: RequestGroup, indices: list[int]) -> None:
        for i in indices:
            rid = group.request_ids[i]
            if rid in self._live:
                self.engine.abort(rid)
                self._emit(rid, [], True, None, reason="abort")
        self._report_stats()

    def _emit(self, rid: str, new_ids: list[int], finished: bool, request, reason: str | None = None,
              error: str | None = None) -> None:
        entry = self._live.get(rid)
        if entry is None:
            return
        group, index = entry
        event = StepEvent(index, list(new_ids), finished, reason)
        if request is not None:
            event.finish_reason = request.finish_reason if finished else None
            event.nfe, event.steps = request.nfe, request.num_steps
            event.drafter_passes = request.drafter_passes
            event.num_committed = int((request.answer != request.mask_id).sum())
            if group.want_canvas:
                event.canvas_ids = request.answer.tolist()
                event.draft_ids = self.engine.pending_drafts(request)
            error = error or request.error
            event.error_code = request.error_code
            if request.params.logprobs is not None:
                first = request.num_emitted - len(new_ids)
                event.logprobs = [request.logprob_entries.get(p) for p in range(first, request.num_emitted)]
                end = request.logprob_entries.get(request.num_emitted) if finished else None
                if end is not None and end.token_id in request.ends(self.engine.eos_id):
                    event.end_logprob = end  # the end id that ended the answer (not in new_token_ids)
            if request.prompt_logprob_entries is not None and index not in group._prompt_scores_sent:
                group._prompt_scores_sent.add(index)
                event.prompt_logprobs = list(request.prompt_logprob_entries)
        event.error = error
        if finished:
            del self._live[rid]
            group._unfinished.discard(index)
            self._release(1)
        group._deliver(event)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._live):
            self.engine.abort(rid)
            self._emit(rid, [], True, None, reason="error", error=message)
        self._report_stats()

    def _report_stats(self) -> None:
        if self.on_stats is None:
            return
        sched = self.engine.scheduler
        waiting = sum(not r.is_finished for r in sched.waiting)
        running = sum(not r.is_finished for r in sched.running)
        self.on_stats(waiting, running)
