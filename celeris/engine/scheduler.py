"""Scheduler: owns the waiting queue, the running set and the per-step budgets.

Continuous batching for masked diffusion: every step runs the current block of
every running request in one forward pass; new requests are admitted at step
boundaries while both budgets allow:

- sequences: at most ``max_num_seqs`` running requests;
- tokens: at most ``max_num_batched_tokens`` columns computed in one step, as each request's mode counts them
  (``cost``, which the engine sets to ``Engine.batch_tokens``: the mode paths' ``token_cost``); without a
  ``cost``, ``rows x longest canvas`` (CFG adds an unconditional row), masked diffusion's padded full pass;
- KV rows: at most ``max_num_seqs`` rows of the engine's KV store held (``kv_rows``, which the engine sets to
  ``Engine.kv_rows``; a CFG request with a cache holds two); none counted without it.

Admission is first come, first served; a request that does not fit waits (a
request that could never fit alone is still admitted when nothing else runs,
so it cannot starve).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from celeris.config import EngineConfig
from celeris.engine.request import Request, RequestStatus


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting``; the caller should retry later (HTTP 429)."""


def _rows(request: Request) -> int:
    return 2 if request.params.cfg_scale > 0 else 1


class Scheduler:
    """FCFS waiting queue plus the running set, within ``config``'s sequence and token budgets (module docstring)."""

    def __init__(self, config: EngineConfig, cost: Callable[[list[Request]], int] | None = None) -> None:
        self.config = config
        self.cost = cost
        self.kv_rows: Callable[[list[Request]], int] | None = None  # rows of the KV store a set of requests holds
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        """Queue a request; raises QueueFullError when ``max_waiting`` requests already wait
        beyond those that will take a free running slot at the next step."""
        free_slots = max(0, self.config.max_num_seqs - sum(not r.is_finished for r in self.running))
        if len(self.waiting) >= self.config.max_waiting + free_slots:
            raise QueueFullError(f"the queue is full ({self.config.max_waiting} requests waiting)")
        self.waiting.append(request)

    def batch_tokens(self, requests: list[Request]) -> int:
        """Tokens one step over ``requests`` computes: ``cost``'s count, else padded rows x the longest canvas."""
        if self.cost is not None:
            return self.cost(requests)
        if not requests:
            return 0
        return sum(_rows(r) for r in requests) * max(r.num_tokens for r in requests)

    def schedule(self) -> list[Request]:
        """Drop finished requests, admit waiting ones within budget, return the batch to run."""
        self.running = [r for r in self.running if not r.is_finished]
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            candidate = self.waiting[0]
            if candidate.is_finished:  # aborted while waiting
                self.waiting.popleft()
                continue
            batch = [*self.running, candidate]
            fits = self.batch_tokens(batch) <= self.config.max_num_batched_tokens and (
                self.kv_rows is None or self.kv_rows(batch) <= self.config.max_num_seqs)
            if not fits and self.running:
                break
            self.waiting.popleft()
            candidate.status = RequestStatus.RUNNING
            self.running.append(candidate)
        return list(self.running)

    def abort(self, request_id: str) -> Request | None:
        """Mark a waiting or running request aborted; it is dropped at the next ``schedule``."""
        for request in [*self.running, *self.waiting]:
            if request.request_id == request_id and not request.is_finished:
                request.finish("abort", RequestStatus.ABORTED)
                if request in self.waiting:  # frees its queue place at once
                    self.waiting.remove(request)
                return request
        return None

    @property
    def num_unfinished(self) -> int:
        return sum(not r.is_finished for r in [*self.running, *self.waiting])
