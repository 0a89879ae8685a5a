"""One API request in flight: its choices' state (``Choice``), the run (``Run``), and ``RunDriver``, the half
of ``OpenAIServing`` that turns the engine's step events of a run into text updates (time-outs, client
disconnects, stop strings, grammar checks, the streamed pieces)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from celeris.sampling.logprobs import TokenLogprob
from celeris.serve.async_engine import RequestGroup, StepEvent
from celeris.serve.detokenize import Update, decoding_details, denoise_details
from celeris.serve.protocol import APIError, DecodingDetails, UsageInfo
from celeris.structured.grammar import answer_matches
from celeris.text import IncrementalText, render_canvas, tokens_within

DISCONNECT_POLL_S = 0.01  # most seconds between two client-disconnect checks while events flow
IDLE_WAKE_S = 0.25  # wake this often when no event comes, to check time-out and disconnect
RETRY_AFTER_S = 1  # seconds a 429 / 503 asks the client to wait (Retry-After)

IsDisconnected = Callable[[], Awaitable[bool]]


class ClientDisconnected(Exception):
    """The client went away; its requests were aborted."""


@dataclass
class Choice:
    """One choice of a run: its text so far, finish reason, decoding details and log-probabilities."""

    text: IncrementalText
    finish_reason: str | None = None
    done: bool = False
    details: DecodingDetails | None = None
    token_steps: list[int | None] | None = None  # stream_mode "denoise": the step that committed each position
    logprobs: list[TokenLogprob | None] = field(default_factory=list)  # one per answer token received
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the scored prompt (echo with logprobs)
    num_sent_logprobs: int = 0  # streamed: entries already sent
    end_logprob: TokenLogprob | None = None  # the end token's entry, when an end id ended the answer
    with_end: bool = False  # completions: the end token's entry follows the answer's (vLLM keeps it)

    def _end(self) -> list[TokenLogprob | None]:
        stopped = self.text.stopped or self.end_logprob is None or not self.with_end
        return [] if stopped else [self.end_logprob]

    def released_logprobs(self) -> list[TokenLogprob | None]:
        """Streaming: the entries of the tokens behind the text handed out since the last call."""
        text = self.text
        n = text.num_tokens() if self.done else tokens_within(text.decode, text.token_ids, len(text.text))
        out = self.logprobs[self.num_sent_logprobs : n]
        self.num_sent_logprobs = max(self.num_sent_logprobs, n)
        return out + (self._end() if self.done else [])

    def answer_logprobs(self) -> list[TokenLogprob | None]:
        """The entries of the returned answer's tokens (those before a stop string), and for completions the end
        token's that ended it."""
        return self.logprobs[: self.text.num_tokens()] + self._end()


@dataclass
class Run:
    """The state of one API request: its engine group, its choices and its deadline."""

    group: RequestGroup
    choices: list[Choice]
    prompt_tokens: int
    arrival: float
    deadline: float
    stream_mode: str
    is_disconnected: IsDisconnected | None
    logprobs: bool = False  # the request asked for log-probabilities (streams carry them)
    first_text_time: float | None = None
    abort_reason: str | None = None
    last_disconnect_check: float = 0.0

    def usage(self) -> UsageInfo:
        completion = sum(c.text.num_tokens() for c in self.choices)
        nfe = sum(c.details.nfe for c in self.choices if c.details is not None)
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                         total_tokens=self.prompt_tokens + completion, nfe=nfe)


class RunDriver:
    """Drives one ``Run``: awaits its engine events, applies them to its choices, and yields ``Update``s.

    A base of ``OpenAIServing``, whose ``llm``, ``tokenizer``, ``metrics``, ``request_timeout``, ``mask_id``,
    ``eos_id`` and ``cutting_off`` it reads."""

    def _piece(self, token_id: int) -> str:
        """One token's text alone (special tokens as "")."""
        return self.tokenizer.decode([token_id], skip_special_tokens=True)

    # -- driving a request ------------------------------------------------------------------------

    async def _next_event(self, run: Run) -> StepEvent:
        """The next engine event, checking the deadline and (at most every DISCONNECT_POLL_S) the client."""
        while True:
            t = time.perf_counter()
            if self.cutting_off:
                run.abort_reason = "shutdown"
                run.group.abort()
                raise APIError(503, "the server is shutting down and cut this request off at the end of its drain "
                                    "period; retry", code="server_shutting_down",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            if t >= run.deadline:
                run.abort_reason = "timeout"
                run.group.abort()
                raise APIError(504, f"the request did not finish within the server's request timeout of "
                                    f"{self.request_timeout:g} s and was aborted", code="request_timeout")
            if run.is_disconnected is not None and t - run.last_disconnect_check >= DISCONNECT_POLL_S:
                run.last_disconnect_check = t
                if await run.is_disconnected():
                    run.abort_reason = "disconnect"
                    run.group.abort()
                    raise ClientDisconnected()
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can drop an item its inner get already took.
                async with asyncio.timeout(min(run.deadline - t, IDLE_WAKE_S)):
                    return await run.group.events.get()
            except TimeoutError:
                continue

    async def _updates(self, run: Run) -> AsyncIterator[Update]:
        """One Update per engine event until every choice is done; aborts what is left on exit."""
        try:
            while not all(c.done for c in run.choices):
                event = await self._next_event(run)
                choice = run.choices[event.index]
                if choice.done:  # e.g. the abort that follows a stop string
                    continue
                if event.finish_reason == "error":
                    code = event.error_code or "engine_error"
                    self.metrics.failed.labels(code=code).inc()
                    raise APIError(500, event.error or "the engine failed this request", code=code)
                if event.finish_reason == "abort":
                    raise APIError(500, event.error or "the request was aborted by the engine", code="engine_error")
                if event.steps or event.nfe:  # (a scored prompt alone takes a pass and no step)
                    choice.details = decoding_details(run.group.inputs[event.index].params, event)
                if event.logprobs:
                    choice.logprobs.extend(event.logprobs)
                if event.prompt_logprobs is not None:
                    choice.prompt_logprobs = event.prompt_logprobs
                choice.end_logprob = event.end_logprob or choice.end_logprob
                delta = choice.text.push(event.new_token_ids, final=event.finished)
                if choice.text.stopped and not event.finished:
                    self.metrics.aborted.labels(reason="stop").inc()
                    run.group.abort([event.index])  # a stop string ended it: free the slot now
                if event.finished or choice.text.stopped:
                    choice.done = True
                    choice.finish_reason = "stop" if choice.text.stopped else (event.finish_reason or "length")
                    self._check_constrained(run, event.index)
                    self.metrics.nfe.observe(event.nfe)
                if delta and run.first_text_time is None:
                    run.first_text_time = time.perf_counter()
                    self.metrics.ttft.observe(run.first_text_time - run.arrival)
                canvas = None
                details = choice.details if choice.done else None
                if run.stream_mode == "denoise" and event.canvas_ids is not None:
                    if not choice.done:
                        canvas = render_canvas(self.tokenizer.decode, event.canvas_ids, self.mask_id, self.eos_id)
                    if choice.details is not None:
                        if choice.token_steps is None:
                            choice.token_steps = [None] * len(event.canvas_ids)
                        details = denoise_details(choice.details, choice.token_steps, event, self.mask_id,
                                                  self._piece)
                yield Update(event.index, delta, choice.finish_reason if choice.done else None, canvas, event.steps,
                             details)
            usage = run.usage()
            self.metrics.output_tokens.inc(usage.completion_tokens)
            self.metrics.prompt_tokens.inc(usage.prompt_tokens)
            self.metrics.e2e.observe(time.perf_counter() - run.arrival)
        finally:
            if not all(c.done for c in run.choices):
                # Time-out, disconnect noticed here, or the consumer went away (a cancelled stream:
                # the client disconnected) or failed: free the slots at the next step boundary.
                run.group.abort()
                self.metrics.aborted.labels(reason=run.abort_reason or "disconnect").inc()

    def _check_constrained(self, run: Run, index: int) -> None:
        """A finished constrained answer is returned as ``stop`` only if it is a complete sentence of its grammar
        (``answer_matches``): one cut by the budget stays ``length``; any other is a 500 ``invalid_output``
        (an error event when streamed), counted in ``celeris_failed_requests``. A stop string ends free text
        only (``stops_apply``), so an answer it ended is not checked."""
        choice, grammar = run.choices[index], run.group.inputs[index].params.grammar
        if grammar is None or choice.finish_reason != "stop" or choice.text.stopped:
            return
        if answer_matches(grammar, self.llm.grammar_tokenizer, choice.text.token_ids):
            return
        run.abort_reason = "error"
        self.metrics.failed.labels(code="invalid_output").inc()
        raise APIError(500, "the answer ended before it was complete under its response_format or tool grammar "
                            "(it does not validate), so it is not returned", code="invalid_output")

    async def _collect(self, run: Run) -> list[str]:
        async for _ in self._updates(run):
            pass
        return [c.text.text for c in run.choices]

    def _stream_text(self, run: Run, update: Update) -> str | None:
        """The text a chunk carries for ``update``; None when there is nothing to send."""
        if run.stream_mode == "denoise":
            if update.finish_reason is not None:
                return run.choices[update.index].text.text  # the final answer replaces the last canvas
            return update.canvas
        if not update.delta and update.finish_reason is None:
            return None
        return update.delta

    async def _stream_pieces(self, run: Run) -> AsyncIterator[tuple[Update, str, int | None]]:
        """(update, text to send, denoising step or None) for every update that has something to send;
        shared by the completion and chat streams. Closes the update stream however the caller stops."""
        updates = self._updates(run)
        try:
            async for u in updates:
                text = self._stream_text(run, u)
                if text is not None:
                    if run.logprobs:
                        u.logprobs = run.choices[u.index].released_logprobs()
                    yield u, text, u.step if run.stream_mode == "denoise" else None
        finally:
            await updates.aclose()
