"""Request: one generation in flight, with its canvas, block cursor, step count and timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from celeris.sampling.cache import CACHE_MODES, cache_window, visible_end
from celeris.sampling.logprobs import TokenLogprob
from celeris.sampling.params import SamplingParams
from celeris.sampling.schedule import block_plan
from celeris.sampling.step import check_prompts, make_generator

NO_PROGRESS = "no_progress"  # error code: a denoising step committed nothing (see ``Engine.step``)


class RequestStatus(enum.Enum):
    """Lifecycle: WAITING (queued) -> RUNNING (scheduled) -> FINISHED, or ABORTED from either."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Request:
    """A request's whole state.

    The canvas is ``prompt | answer (max_tokens, mask id until committed) | suffix``
    as a 1-D int64 CPU tensor of length ``num_tokens``. The answer is denoised
    block by block (``blocks``); ``schedule`` holds the tokens to commit at each
    step of the current block under ``fixed`` decoding.

    Timings are ``time.perf_counter()`` seconds; ``nfe`` counts forward passes
    this request took part in (a CFG step counts 2).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    mask_id: int
    suffix_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    nfe: int = 0
    drafter_passes: int = 0  # passes of a DFlash drafter for this request (verified decoding)
    num_steps: int = 0  # denoising steps taken (the budget is params.steps)
    finish_reason: str | None = None
    error_code: str | None = None  # set with finish_reason "error": e.g. NO_PROGRESS
    error: str | None = None  # what went wrong, one sentence
    # Ids that end the answer (the model's end ids unless ignore_eos, plus params.stop_token_ids); None: the
    # ``eos_id`` given to ``advance`` / ``final_prefix``.
    stop_ids: frozenset[int] | None = None
    # The grammar state of a constrained request (``celeris.structured.grammar.Constraint``), else None.
    constraint: object | None = None
    # Its DRY settings (``celeris.sampling.dry.DrySettings``, breakers as ids), set at admission; None: no DRY.
    dry: object | None = None
    # With ``params.logprobs``: answer position -> its committed token's entry (``celeris.sampling.logprobs``).
    logprob_entries: dict[int, TokenLogprob] = field(default_factory=dict)
    # With ``params.prompt_logprobs``: one entry per prompt token (None for the first), filled at its first step.
    prompt_logprob_entries: list[TokenLogprob | None] | None = None
    # Score the prompt and finish without decoding (OpenAI's echo with max_tokens 0): no answer token.
    score_only: bool = False
    # The decoding mode (``celeris.sampling.modes.MODES``), decided once at admission (``Engine.add_request``).
    mode: str = "masked"
    # The mode's own cursor for this request, owned by the engine's path for ``mode``: a ``BlockRow`` (block
    # path), a ``DraftRow`` (verified path); None under masked diffusion, whose cursor is this object's own
    # block fields (``blocks``, ``block_idx``, ``schedule``).
    state: object | None = None
    # Chunked prefill (``celeris.engine.scheduler``): the prompt columns whose keys/values are computed ahead of
    # the first step, a chunk per step (0: the prompt is prefilled whole by the first step's pass), how many of
    # them are done, and this step's chunk (set by the scheduler each step; 0 when not prefilling).
    prefill_target: int = 0
    num_computed: int = 0
    prefill_chunk: int = 0
    # Prompt tokens whose keys/values its KV row took from the engine's prefix cache (``celeris.engine.kv``) at its
    # first step, under the masked path's causal decoding: its first step computes only the columns after them.
    num_cached: int = 0

    def __post_init__(self) -> None:
        check_prompts([self.prompt_ids])
        n = self.params.max_tokens
        self.canvas = torch.tensor(self.prompt_ids + [self.mask_id] * n + self.suffix_ids, dtype=torch.long)
        self.answer_start = len(self.prompt_ids)
        self.blocks, self.steps_per_block = block_plan(n, self.params.block_length, self.params.steps)
        self.block_idx = 0
        self.step_in_block = 0
        self.generator = make_generator(self.params.seed)
        self.num_emitted = 0  # answer tokens already handed out as final (streaming)
        self.stale_cols: list[int] = []  # columns committed at the previous block's last step (delayed cache)
        self._new_block()

    @property
    def steps(self) -> int:
        """Deprecated name of ``num_steps``."""
        return self.num_steps

    @steps.setter
    def steps(self, value: int) -> None:
        self.num_steps = value

    @property
    def num_tokens(self) -> int:
        return self.canvas.numel()

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    @property
    def is_prefilling(self) -> bool:
        """Its prompt is still being prefilled in chunks: it computes ``prefill_chunk`` prompt columns this step,
        commits and emits nothing."""
        return self.num_computed < self.prefill_target

    @property
    def block_span(self) -> tuple[int, int]:
        """Canvas columns [start, end) of the block being denoised."""
        s, e = self.blocks[self.block_idx]
        return self.answer_start + s, self.answer_start + e

    @property
    def visible_end(self) -> int:
        """Canvas columns [0, visible_end) this step's passes see (``SamplingParams.suffix_window``)."""
        return visible_end(self.num_tokens, self.block_span[1], self.params.suffix_window)

    @property
    def answer(self) -> torch.Tensor:
        """(max_tokens,) int64 view of the answer span."""
        return self.canvas[self.answer_start : self.answer_start + self.params.max_tokens]

    def _new_block(self) -> None:
        s, e = self.block_span
        self.block_steps = min(self.steps_per_block, e - s)
        num_masked = self._masked_in(s, e)
        base, extra = divmod(num_masked, self.block_steps)  # num_transfer_tokens' linear schedule, in Python ints
        self.schedule = [base + (i < extra) for i in range(self.block_steps)]  # (S,): tokens per step
        self.step_in_block = 0

    def _masked_in(self, s: int, e: int) -> int:
        """Masked positions among canvas columns [s, e) (a block of one column, next-token decoding's, read as one
        element: a step makes one of these calls per request)."""
        if e - s == 1:
            return int(int(self.canvas[s]) == self.mask_id)
        return int((self.canvas[s:e] == self.mask_id).sum())

    def cache_columns(self) -> tuple[list[int], int] | None:
        """Canvas columns this step computes with a KV cache and where the block starts among them, or
        None for a full pass: the cache policy's rule (``celeris.sampling.cache.cache_window``, plus
        ``stale_cols`` at a block's first step under a policy that ``rewrites_stale``). After a chunked prefill
        (``prefill_target``) the first step computes just the first block: the prompt's keys/values are cached;
        after a prefix cache hit (``num_cached``) it computes the rest of the prompt and the first block."""
        if (self.prefill_target or self.num_cached) and self.block_idx == 0 and self.step_in_block == 0:
            start = self.block_span[0] if self.prefill_target else self.num_cached  # the prompt's columns held
            return list(range(start, self.block_span[1])), self.block_span[0] - start
        window = cache_window(self.params.cache, self.blocks, self.block_idx, self.answer_start, self.visible_end,
                              self.step_in_block, self.params.cache_refresh)
        if window is None:
            return None
        stale = self.stale_cols if CACHE_MODES[self.params.cache].rewrites_stale and self.step_in_block == 0 else []
        return stale + list(range(*window)), len(stale) + self.block_span[0] - window[0]

    def tokens_this_step(self) -> int:
        """Tokens to commit now under ``fixed`` decoding (linear schedule)."""
        return int(self.schedule[min(self.step_in_block, self.block_steps - 1)])

    def ends(self, eos_id: int | None = None) -> frozenset[int]:
        """The ids that end this answer (``stop_ids``, else ``{eos_id}``)."""
        return self.stop_ids if self.stop_ids is not None else frozenset({eos_id})

    def final_prefix(self, eos_id: int | None = None) -> list[int]:
        """The committed left-to-right prefix of the answer, cut before the first id that ends it (``ends``).

        These tokens never change again, so they can be streamed.
        """
        ids = self.answer.tolist()
        end = ids.index(self.mask_id) if self.mask_id in ids else len(ids)
        ends = self.ends(eos_id)
        stop = next((i for i, t in enumerate(ids[:end]) if t in ends), end)
        return ids[:stop]

    def record_step(self, passes: int = 1) -> None:
        """Count one step of this request, whatever its mode, once its canvas holds the step's tokens: ``passes``
        forward passes into ``nfe`` (2 for a CFG step), one into ``num_steps``, and the time of the first answer
        token (``first_token_time``) when the answer's first position has just become final."""
        self.nfe += passes
        self.num_steps += 1
        if self.first_token_time is None and int(self.answer[0]) != self.mask_id:
            self.first_token_time = time.perf_counter()

    def advance(self, eos_id: int, committed_cols: list[int] | None = None) -> None:
        """After a committed masked-diffusion step (counted by ``record_step``; ``committed_cols``: the canvas
        columns it filled): move to the next block, or finish (end of answer / early exit)."""
        self.step_in_block += 1
        s, e = self.block_span
        if self._masked_in(s, e):
            return
        answer_so_far = self.canvas[self.answer_start : e].tolist()
        hit_eos = not self.ends(eos_id).isdisjoint(answer_so_far)
        if self.block_idx + 1 == len(self.blocks) or (self.params.early_exit and hit_eos):
            self.finish("stop" if hit_eos else "length")
            return
        self.block_idx += 1
        self._new_block()
        self.stale_cols = list(committed_cols or [])  # computed while still masked: rewritten at the next step

    def fail(self, code: str, message: str) -> None:
        """End the request with ``finish_reason`` "error", an error ``code`` and a ``message`` (the failed step is
        counted by ``record_step``)."""
        self.error_code, self.error = code, message
        self.finish("error")

    def finish(self, reason: str, status: RequestStatus = RequestStatus.FINISHED) -> None:
        """End the request with ``finish_reason`` ``reason`` ("stop", "length", "abort", "error").

        The runner frees its KV cache rows at its next step."""
        self.status = status
        self.finish_reason = reason
        self.finish_time = time.perf_counter()
