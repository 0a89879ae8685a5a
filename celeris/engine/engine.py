"""Engine: ``step()`` = schedule, run, commit, finish.

Offline ``LLM.generate``, the HTTP server and batch jobs all drive this same
``step()``. Every running request moves one denoising step per call, whatever
its own settings; new requests join at step boundaries (continuous batching).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from celeris.config import EngineConfig
from celeris.engine.blocks import BlockDecoder
from celeris.engine.kv import PREFIX_CACHE_TOKENS
from celeris.engine.request import NO_PROGRESS, Request
from celeris.engine.runner import ModelRunner
from celeris.engine.scheduler import Scheduler
from celeris.engine.verified import DraftRow, VerifiedDecoder
from celeris.params import SamplingParams
from celeris.sampling.block import contract_of, with_block_defaults
from celeris.sampling.logprobs import prompt_entries, step_entries
from celeris.sampling.modes import check_fits_context, check_request, mode_of
from celeris.sampling.step import (
    RowSettings,
    banned_token_ids,
    commit_step,
    confidence_rule,
    context_tokens,
    prepare_logits,
)
from celeris.structured.grammar import row_constraints


@dataclass(slots=True)
class StepOutput:
    """What one step did for one request.

    Attributes:
        request: the request (its canvas, timings and counters are up to date).
        new_token_ids: answer tokens that became final (the committed
            left-to-right prefix, cut before end-of-text) during this step.
        finished: the request is done (``request.finish_reason`` says why).
    """

    request: Request
    new_token_ids: list[int]
    finished: bool


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What an engine holds and has done, read by the server's metrics and the bench (``Engine.stats``).

    Attributes:
        num_waiting / num_running: requests in the scheduler's queues.
        num_steps: ``Engine.step`` calls that ran a batch.
        kv_bytes: bytes of key/value storage held now by every KV store of the engine (the masked path's pool,
            the block path's pool and the verified path's preallocated pool, prefix caches not included): the one
            KV figure.
        prefix_cache_queries / prefix_cache_hits: prompt tokens looked up in the verified path's prefix cache,
            and of those the tokens whose keys/values came from it (vLLM's ``prefix_cache_queries``/``_hits``).
        drafted / accepted: per draft position j = 1..k, drafts checked and accepted under verified decoding.
    """

    num_waiting: int = 0
    num_running: int = 0
    num_steps: int = 0
    kv_bytes: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    drafted: tuple[int, ...] = ()
    accepted: tuple[int, ...] = ()


class Engine:
    """Owns a Scheduler and a ModelRunner for one model.

    Args:
        model: a model with ``config.mask_token_id / eos_token_id / pad_token_id``
            whose forward takes (ids, bool attention mask, logits_slice).
        config: batching budgets and queue length.
        end_ids: every id that ends an answer (``Tokenizer.end_token_ids``: end-of-text, the generation
            config's ``eos_token_id`` list, end-of-turn tokens); default: the model config's end-of-text id.
        grammar_tokenizer: llguidance's tokenizer (``celeris.structured.grammar_tokenizer``), needed for
            requests with a ``grammar`` (constrained decoding, the reference sampler's rule).
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None,
                 end_ids: list[int] | None = None, grammar_tokenizer: object | None = None) -> None:
        self.config = config or EngineConfig()
        self.scheduler = Scheduler(self.config)
        self.runner = ModelRunner(model, self.config.enforce_eager, self.config.length_bucket)
        config = model.config
        self.mask_id, self.eos_id = config.mask_token_id, config.eos_token_id
        self.banned_ids = banned_token_ids(config)
        self.confidence_from = confidence_rule(model)
        self.end_ids = frozenset(end_ids if end_ids is not None else [self.eos_id])
        self.model = model
        self.grammar_tokenizer = grammar_tokenizer
        self._ids = itertools.count()
        self.num_steps = 0
        # the most tokens a request holds (EngineConfig.max_model_len, else the model's window): sizes the KV pool
        self.max_model_len = self.config.max_model_len or getattr(config, "max_position_embeddings", None)
        self.drafter: VerifiedDecoder | None = None  # verified decoding (hybrid models), made at first use
        self._draft_rows: dict[Request, DraftRow] = {}
        contract = contract_of(model)  # a block-diffusion model (or a hybrid's block mode): the block path
        self.block_decoder = BlockDecoder(model, contract) if contract is not None else None
        if self.block_decoder is not None:
            self.block_decoder.logprobs_mode = self.config.logprobs_mode

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        suffix_ids: list[int] | None = None,
        request_id: str | None = None,
        score_only: bool = False,
    ) -> Request:
        """Queue a request. ``score_only``: score the prompt (``params.prompt_logprobs``) and finish with no answer
        token (OpenAI's ``echo`` with ``max_tokens`` 0).

        Raises:
            ValueError: empty prompt, or settings the model cannot decode (``check_request``: an
                unsupported cache; for an autoregressive model, blocks longer than one token, CFG, a suffix;
                a grammar without ``grammar_tokenizer``, or one that does not compile); ``prompt_logprobs`` on a
                model that is not causal.
            QueueFullError: the waiting queue is full.
        """
        params = with_block_defaults(self.model, params)  # a block model's sub-block when left at the default
        mode = check_request(self.model, params, bool(suffix_ids))
        if mode == "verified" and self.max_model_len:  # its KV pool rows hold max_model_len tokens
            check_fits_context(len(prompt_ids), 0, params.max_tokens, self.max_model_len)
        if params.prompt_logprobs is not None and not getattr(self.model.config, "is_causal", False):
            raise ValueError("prompt_logprobs needs a causal (autoregressive or hybrid) model; a diffusion model has "
                             "no left-to-right likelihood of its prompt")
        request = Request(request_id or f"req-{next(self._ids)}", list(prompt_ids), params, self.mask_id,
                          list(suffix_ids or []), score_only=score_only)
        # under a grammar the answer ends where the grammar lets it end: a stop token id inside the constrained text
        # (a JSON character) would cut it invalid, so stop_token_ids apply only without a grammar
        stops = frozenset(params.stop_token_ids) if params.grammar is None else frozenset()
        request.stop_ids = (frozenset() if params.ignore_eos else self.end_ids) | stops
        request.constraint = row_constraints([params], self.grammar_tokenizer)[0]
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; it takes no further steps. Returns whether one was found."""
        found = self.scheduler.abort(request_id) is not None
        if found:
            self._free_finished()
        return found

    def _free_finished(self) -> None:
        """Free the KV rows (block path, runner, verified drafter) of finished or aborted requests at once, so no
        memory outlives a request even when no further step runs."""
        if self.block_decoder is not None:
            self.block_decoder.release_finished()
        self.runner.release({r for r, _ in self.runner.pool.owners if not r.is_finished})
        for request in [r for r in self._draft_rows if r.is_finished]:
            self.drafter.remove(self._draft_rows.pop(request))

    def stats(self) -> EngineStats:
        """The engine's counters and its one KV figure (``EngineStats``), without reaching into its paths."""
        drafter, blocks = self.drafter, self.block_decoder
        cache = drafter.prefix_cache if drafter is not None else None
        kv = self.runner.pool.nbytes + (blocks.pool.nbytes if blocks is not None else 0)
        kv += drafter.pool_bytes if drafter is not None else 0
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=sum(not r.is_finished for r in self.scheduler.running),
            num_steps=self.num_steps, kv_bytes=kv,
            prefix_cache_queries=cache.query_tokens if cache else 0, prefix_cache_hits=cache.hit_tokens if cache else 0,
            drafted=tuple(drafter.drafted) if drafter else (), accepted=tuple(drafter.accepted) if drafter else ())

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def pending_drafts(self, request: Request) -> list[int]:
        """Under verified decoding, the drafts the request's next pass checks (token ids for the answer positions
        right after its committed tokens); [] for other requests and after the last pass."""
        row = self._draft_rows.get(request)
        return list(row.drafts) if row is not None and not row.finished else []

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """Run one denoising step for every scheduled request; returns one StepOutput each."""
        batch = self.scheduler.schedule()
        if not batch:
            self._free_finished()  # e.g. every request was aborted since the last step
            return []
        outputs = self._score_prompts(batch)
        if outputs:
            batch = [r for r in batch if not r.is_finished]
        modes = {r: mode_of(self.model, r.params) for r in batch}
        verified = [r for r in batch if modes[r] == "verified"]
        outputs += self._step_verified(verified) if verified or self._draft_rows else []
        batch = [r for r in batch if modes[r] != "verified"]
        if not batch:
            self.num_steps += 1
            return outputs
        if self.block_decoder is not None:  # celeris.engine.blocks: one pass, exact KV cache of the history
            blocks = [r for r in batch if modes[r] == "block"]
            if blocks or self.block_decoder.rows:
                outputs += [self._emit(r) for r in self.block_decoder.step(blocks)]
            in_blocks = set(blocks)
            batch = [r for r in batch if r not in in_blocks]
            if not batch:
                self.num_steps += 1
                return outputs
        logits, block = self.runner.run(batch)
        settings = RowSettings.from_params([r.params for r in batch], logits.device)
        num_tokens = torch.tensor([r.tokens_this_step() for r in batch], device=logits.device)
        seen = None
        if any(r.params.repetition_penalty != 1 for r in batch):
            seen = context_tokens([r.canvas for r in batch], logits.shape[-1], self.mask_id, logits.device)
        widths = [r.block_span[1] - r.block_span[0] for r in batch]
        step = commit_step(logits, block, self.mask_id, self.eos_id, self.banned_ids, num_tokens, settings,
                           [r.generator for r in batch], seen, widths, self.confidence_from,
                           [r.constraint for r in batch],
                           [r.answer_start + r.params.max_tokens - r.block_span[0] for r in batch])
        new_block, committed = step.block, step.committed
        if any(r.params.logprobs is not None for r in batch):  # asking for nothing costs nothing
            self._record_logprobs(batch, logits, new_block, committed, settings, seen, step.allowed)
        new_block, committed, stalled = new_block.cpu(), committed.cpu(), step.stalled.tolist()
        for i, r in enumerate(batch):
            s, e = r.block_span
            r.canvas[s:e] = new_block[i, : e - s]  # a short block's pad columns are dropped
            r.nfe += 2 if r.params.cfg_scale > 0 else 1
            if stalled[i]:  # progress guarantee: never take another step in vain
                r.fail(NO_PROGRESS, f"denoising step {r.num_steps + 1} committed no token (the model's scores for the "
                                    f"masked positions are not finite numbers), so the request was ended")
            else:
                r.advance(self.eos_id, (s + committed[i, : e - s].nonzero().flatten()).tolist())
                if r.constraint is not None and r.constraint.stopped and not r.is_finished:
                    r.finish("stop")  # the grammar allows nothing but the end: no pass for that token
            outputs.append(self._emit(r))
        if any(o.finished for o in outputs):  # free finished requests' KV rows now, not at the next step
            self.runner.release({r for r in batch if not r.is_finished})
        self.num_steps += 1
        return outputs

    def _score_prompts(self, batch: list[Request]) -> list[StepOutput]:
        """Score the prompts of newly scheduled requests that ask (``prompt_logprobs``: one causal pass each,
        ``celeris.sampling.logprobs.prompt_entries``), and finish the ``score_only`` ones; their StepOutputs."""
        outputs = []
        for r in batch:
            if r.params.prompt_logprobs is not None and r.prompt_logprob_entries is None:
                r.prompt_logprob_entries = prompt_entries(self.model, r.prompt_ids, r.params.prompt_logprobs)
                r.nfe += 1
            if r.score_only and not r.is_finished:
                r.finish("length")
                outputs.append(self._emit(r))
        return outputs

    def _record_logprobs(self, batch: list[Request], logits: torch.Tensor, new_block: torch.Tensor,
                         committed: torch.Tensor, settings: RowSettings, seen: torch.Tensor | None,
                         allowed: torch.Tensor | None) -> None:
        """Store the log-probabilities of the tokens this step committed for the requests that ask
        (``celeris.sampling.logprobs.step_entries``, raw or processed as ``EngineConfig.logprobs_mode`` says)."""
        processed = None
        if self.config.logprobs_mode == "processed_logprobs":
            processed, _ = prepare_logits(logits, settings, self.banned_ids, seen, allowed)
        rows = step_entries(logits, new_block, committed, [r.params.logprobs for r in batch], processed,
                            settings.temperature)
        for r, row in zip(batch, rows, strict=True):
            offset = r.block_span[0] - r.answer_start
            r.logprob_entries.update({offset + c: e for c, e in row.items() if offset + c < r.params.max_tokens})

    def _emit(self, request: Request) -> StepOutput:
        """The answer tokens that became final since the request's last StepOutput (streaming)."""
        prefix = request.final_prefix(self.eos_id)
        new_ids = prefix[request.num_emitted :]
        request.num_emitted = len(prefix)
        return StepOutput(request, new_ids, request.is_finished)

    def _step_verified(self, batch: list[Request]) -> list[StepOutput]:
        """One verified-decoding pass for ``batch`` (``celeris.engine.verified.VerifiedDecoder``): rows of
        requests that finished or were aborted are freed, new requests are prefilled, the others advance by
        their accepted drafts plus one token. Each request's committed tokens are final at once (streamed)."""
        if self.drafter is None:
            self.drafter = VerifiedDecoder(self.model, self.config.max_num_seqs, self.max_model_len,
                                           PREFIX_CACHE_TOKENS if self.config.enable_prefix_caching else 0)
            self.drafter.logprobs_mode = self.config.logprobs_mode
        running = set(batch)
        for request in [r for r in self._draft_rows if r not in running or r.is_finished]:
            self.drafter.remove(self._draft_rows.pop(request))
        for request in batch:
            if request not in self._draft_rows:
                self._draft_rows[request] = self.drafter.add(request.prompt_ids, request.params,
                                                             request.ends(self.eos_id), request.constraint)
        committed = {id(row): new for row, new in self.drafter.step()}
        outputs = []
        for request in batch:
            row = self._draft_rows[request]
            new = committed.get(id(row), [])
            start = request.answer_start + len(row.answer) - len(new)
            request.canvas[start : start + len(new)] = torch.tensor(new, dtype=torch.long)
            if new and row.params.logprobs is not None:  # the entries of this pass's tokens (``DraftRow``)
                first = len(row.answer) - len(new)
                request.logprob_entries.update({first + j: e for j, e in enumerate(row.new_logprobs[: len(new)])})
            request.nfe += 1
            request.num_steps += 1
            request.drafter_passes = row.draft_state.calls if row.draft_state is not None else 0
            if request.first_token_time is None and new:
                request.first_token_time = time.perf_counter()
            if row.finished:
                # "stop": an end id, or a grammar that allows nothing more (row.hit_eos)
                done = row.hit_eos or not request.ends(self.eos_id).isdisjoint(row.answer)
                request.finish("stop" if done else "length")
                self.drafter.remove(self._draft_rows.pop(request))
            outputs.append(self._emit(request))
        return outputs
