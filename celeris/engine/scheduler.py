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

Chunked prefill (vLLM's): a request whose mode can compute its prompt's keys/values ahead of its first step
(``prefill_columns``, which the engine sets to ``Engine.prefill_columns``: the verified path, the masked path
for a causal model under the ``delayed`` cache, and the block path, whose chunks are whole attention blocks under
``block_causal`` attention: ``celeris.engine.blocks``) and whose whole prefill does not fit beside the running requests
(e.g. a prompt longer than ``max_num_batched_tokens``) is admitted with ``Request.prefill_target`` set: each step
it computes a chunk of its prompt columns (``Request.prefill_chunk``), sized here, after admission, as the most
columns (up to what is left of the prompt) that keep the step's token cost within ``max_num_batched_tokens``
beside the running requests' own columns; its token cost this step is the chunk. It commits and emits nothing until
its prefill is done, and the running requests keep decoding every step meanwhile. Admission leaves room for one
column of each prefill (as its path counts one: a whole block on the block path); a prefill whose running
neighbours leave no room this step pauses (a chunk of 0: the masked path redoes one column it already holds, inside
a pass padded wider anyway; the block path leaves its row out of the pass) and resumes as they finish.
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
        # prompt columns a request's mode can prefill in chunks (0: none); None: no chunked prefill
        self.prefill_columns: Callable[[Request], int] | None = None
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
        """Drop finished requests, admit waiting ones within budget (a request that does not fit whole is admitted
        with a chunked prefill when its mode allows one), size this step's prefill chunks, return the batch."""
        self.running = [r for r in self.running if not r.is_finished]
        for r in self.running:  # a prefill's least chunk, so that admission leaves room for it
            r.prefill_chunk = 1 if r.is_prefilling else 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            candidate = self.waiting[0]
            if candidate.is_finished:  # aborted while waiting
                self.waiting.popleft()
                continue
            if not self._fits([*self.running, candidate]) and not self._chunked(candidate) and self.running:
                break
            self.waiting.popleft()
            candidate.status = RequestStatus.RUNNING
            self.running.append(candidate)
        self._size_chunks()
        return list(self.running)

    def _fits(self, batch: list[Request]) -> bool:
        """One step over ``batch`` stays within the token budget and the KV store's rows."""
        return self.batch_tokens(batch) <= self.config.max_num_batched_tokens and (
            self.kv_rows is None or self.kv_rows(batch) <= self.config.max_num_seqs)

    def _chunked(self, candidate: Request) -> bool:
        """Whether ``candidate`` fits beside the running requests with its prompt prefilled in chunks (one column
        this step, to begin with); if so it is marked for a chunked prefill (``Request.prefill_target``)."""
        columns = self.prefill_columns(candidate) if self.prefill_columns is not None else 0
        if columns <= candidate.num_computed:
            return False
        candidate.prefill_target, candidate.prefill_chunk = columns, 1
        if self._fits([*self.running, candidate]):
            return True
        candidate.prefill_target, candidate.prefill_chunk = 0, 0
        return False

    def _size_chunks(self) -> None:
        """Give each prefilling request, in admission order, the most prompt columns (at most what is left of its
        prompt; 0 when the running requests leave no room: it pauses a step) that keep this step's token cost
        within ``max_num_batched_tokens`` (a binary search: a step's cost grows with a chunk)."""
        for r in self.running:
            if not r.is_prefilling:
                continue
            lo, hi = 0, r.prefill_target - r.num_computed  # find the largest that fits
            while lo < hi:
                r.prefill_chunk = (lo + hi + 1) // 2
                if self.batch_tokens(self.running) <= self.config.max_num_batched_tokens:
                    lo = r.prefill_chunk
                else:
                    hi = r.prefill_chunk - 1
            r.prefill_chunk = lo

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
