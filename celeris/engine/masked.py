"""The engine's masked-diffusion path: one denoising step for every running masked request.

The step's passes (``MaskedPath.passes``) run the runner's model (``celeris.engine.runner.ModelRunner``: compiled
when ``enforce_eager`` is False) over its rows of the engine's KV store (the runner's ``pool``); a step makes at
most two passes (plus CFG rows inside them):

- a full pass for the requests that need one: no cache, a cache to fill (a
  new request) or to refresh (``prefix``/``dual`` at a block's first step,
  ``delayed``/``dual_delayed`` only as ``cache_refresh`` says). A causal model's full pass stops at its block
  (the columns right of it change nothing left of them).
  Rows are padded so every request's block starts at the same column
  ("block-aligned"), with an attention mask, so padding is never attended
  and positions count real tokens only. The keys/values are stored in the
  ``KVPool``.
- one window pass over every live ``KVPool`` row: each row computes only its
  own columns (``Request.cache_columns``) and reads the rest from the pool in
  place. Rows that ran a full pass this step recompute their block
  harmlessly (those keys/values are recomputed before anyone reads them
  stale), which costs less than copying the others out.

and return each request's block logits; this path then commits them through
``celeris.sampling.step.commit_step`` (the reference sampler's composition: grammar, commit rule, grammar
correction, progress check), stores the committed tokens' log-probabilities when asked, and moves each request's
cursor (``Request.advance``: the block, its schedule) or ends it. A request's cursor is the ``Request`` itself
(``request.state`` stays None).

Chunked prefill (``celeris.engine.scheduler``), for a causal model under the ``delayed`` cache: a request still
prefilling takes a row of the pool at once (``KVPool.reserve``) and computes its step's chunk of prompt columns as
its columns of the window pass (logits unused, nothing committed); its first step then computes just its first
block, reading the prompt's keys/values from its row, exact as a full pass is for a causal model.

Automatic prefix caching, under the same conditions (``MaskedPath.prefill_columns``): a new request's KV row first
takes the keys/values of the longest cached block-aligned prefix of its prompt from the engine's prefix cache
(``celeris.engine.kv.PrefixCache``, the verified path's too), and its first step is a window pass over the rest of
its prompt and its first block; after that step its prompt's full blocks are cached.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from celeris.engine.kv import BLOCK_SIZE
from celeris.engine.path import PathContext, pad_groups
from celeris.engine.request import NO_PROGRESS, Request
from celeris.engine.runner import ModelRunner
from celeris.models.layers import KVCache, column_window, gather_positions
from celeris.sampling.cache import CACHE_MODES
from celeris.sampling.dry import row_penalties
from celeris.sampling.logprobs import committed_entries
from celeris.sampling.step import (
    History,
    RowSettings,
    banned_token_ids,
    commit_step,
    confidence_rule,
    guided,
)


class MaskedPath:
    """Runs the masked-diffusion steps of the engine's requests (module docstring).

    Args:
        context: the engine's shared parts (``celeris.engine.path.PathContext``): the runner (its passes and KV
            pool), the model's ids and confidence rule (``celeris.sampling.step.confidence_rule``) and
            ``EngineConfig.logprobs_mode`` ("raw_logprobs" or "processed_logprobs").
    """

    mode = "masked"

    def __init__(self, context: PathContext) -> None:
        self.runner: ModelRunner = context.runner
        config = context.model.config
        self.mask_id, self.eos_id = config.mask_token_id, context.eos_id
        self.banned_ids = banned_token_ids(config)
        self.pad_id = self.runner.pad_id
        self.confidence_from = confidence_rule(context.model)
        self.logprobs_mode = context.config.logprobs_mode
        self.is_causal = bool(getattr(config, "is_causal", False))
        # a causal model scores token t from the hidden state at t - 1 (logits_shift 1): its window passes compute
        # that column and score it unshifted, never the mask column t itself (``_next_token_columns``)
        self.next_token = self.is_causal and getattr(context.model, "logits_shift", 0) == 1
        self._settings: tuple[list, RowSettings] | None = None  # the last step's rows' settings (``_settings_of``)
        self._counts: dict[Request, tuple] = {}  # next-token decoding: each request's answer counts (``_history``)
        self.prefix_cache = self.runner.kv.prefix_cache  # the engine's (``_read_prefix``), None when off

    def token_cost(self, requests: list[Request]) -> int:
        """Tokens the step's passes over ``requests`` process (the scheduler's budget): a request prefilling in
        chunks its chunk (``Request.prefill_chunk``); one whose chunked prefill is done, while the step is a window
        pass, its window's columns (and the column that scores its first); the others, as the full pass pads them,
        rows (a CFG request adds its unconditional row) x their longest canvas (a window pass computes fewer)."""
        full = [r for r in requests if not r.prefill_target]
        cost = sum(2 if r.params.cfg_scale > 0 else 1 for r in full) * max((r.num_tokens for r in full), default=0)
        for r in requests:
            if r.prefill_target:
                window = None if r.is_prefilling else r.cache_columns()
                cost += r.prefill_chunk if r.is_prefilling else r.num_tokens if window is None else len(window[0]) + 1
        return cost

    def prefill_columns(self, request: Request) -> int:
        """Prompt columns a chunked prefill can compute ahead of the first step: the whole prompt for a causal model
        under the ``delayed`` cache without CFG or a suffix (a causal prompt's keys/values are exact, whatever the
        pass that computes them, and that cache's first block reads them from the cache); else 0."""
        p = request.params
        exact = self.is_causal and p.cache == "delayed" and p.cfg_scale == 0 and not request.suffix_ids
        return request.answer_start if exact else 0

    def kv_rows(self, request: Request) -> int:
        """Rows of the KV store a request takes: one with a cache policy that caches (two with CFG), else none."""
        if not CACHE_MODES[request.params.cache].uses_cache:
            return 0
        return 2 if request.params.cfg_scale > 0 else 1

    def release(self) -> None:
        """Free the KV rows (and penalty counts) of finished or aborted requests."""
        self.runner.release({r for r, _ in self.runner.pool.owners if not r.is_finished})
        self._counts = {r: c for r, c in self._counts.items() if not r.is_finished}

    @torch.no_grad()
    def step(self, batch: list[Request]) -> list[Request]:
        """One denoising step for ``batch`` (running masked requests): commit, count (``Request.record_step``),
        advance or finish each; a request prefilling in chunks computes its chunk instead. Returns the requests
        that stepped (``batch`` less those prefilling)."""
        self.runner.release(set(batch))  # first: it moves rows, and the order below is the rows' own
        for r in batch:
            self._read_prefix(r)
        pool = self.runner.pool  # in the order of their KV rows (new ones last): the logits then need no reordering
        batch = sorted(batch, key=lambda r: len(pool.owners) if pool.row(r) is None else pool.row(r))
        logits, block = self.passes(batch)
        stepped = batch  # every running request, prefilling ones included: they keep their KV rows
        prefilled = [r for r in batch if r.is_prefilling]
        for r in prefilled:  # a chunk of its prompt is in the cache now; nothing to commit
            r.num_computed += r.prefill_chunk
            r.nfe += r.prefill_chunk > 0
        if prefilled:
            rows = [i for i, r in enumerate(batch) if r not in prefilled]
            batch, logits, block = [batch[i] for i in rows], logits[rows], block[rows]
            if not batch:
                return []
        for r in batch:
            self._store_prefix(r)
        settings = self._settings_of(batch, logits.device)
        num_tokens = torch.tensor([r.tokens_this_step() for r in batch], device=logits.device)
        history = self._history(batch, settings, logits.shape[-1], logits.device)
        widths = [r.block_span[1] - r.block_span[0] for r in batch]
        step = commit_step(logits, block, self.mask_id, self.eos_id, self.banned_ids, num_tokens, settings,
                           [r.generator for r in batch], history, widths, self.confidence_from,
                           [r.constraint for r in batch],
                           [r.answer_start + r.params.max_tokens - r.block_span[0] for r in batch])
        if any(r.params.logprobs is not None for r in batch):  # asking for nothing costs nothing
            self._record_logprobs(batch, logits, step.block, step.committed, settings, history, step.allowed)
        new_block, committed, stalled = step.block.cpu(), step.committed.cpu(), step.stalled.tolist()
        for i, r in enumerate(batch):
            s, e = r.block_span
            r.canvas[s:e] = new_block[i, : e - s]  # a short block's pad columns are dropped
            r.record_step(2 if r.params.cfg_scale > 0 else 1)
            if stalled[i]:  # progress guarantee: never take another step in vain
                r.fail(NO_PROGRESS, f"denoising step {r.num_steps} committed no token (the model's scores for the "
                                    f"masked positions are not finite numbers), so the request was ended")
            else:
                r.advance(self.eos_id, (s + committed[i, : e - s].nonzero().flatten()).tolist())
                if r.constraint is not None and r.constraint.stopped and not r.is_finished:
                    r.finish("stop")  # the grammar allows nothing but the end: no pass for that token
        if any(r.is_finished for r in batch):  # free finished requests' KV rows now, not at the next step
            self.runner.release({r for r in stepped if not r.is_finished})
        return batch

    def _caches_prefix(self, r: Request) -> bool:
        """Whether ``r``'s prompt goes through the engine's prefix cache: a prompt whose keys/values are exact
        however they are computed (``prefill_columns``: a causal model under the ``delayed`` cache, no CFG, no
        suffix), with prefix caching on (``EngineConfig.enable_prefix_caching``)."""
        return self.prefix_cache is not None and self.prefill_columns(r) > 0

    def _read_prefix(self, r: Request) -> None:
        """At a new request's first step: copy the keys/values of the longest cached prefix of its prompt
        (``PrefixCache.lookup``) into a KV row taken for it, so that its first step computes only the rest of its
        prompt and its first block (``Request.cache_columns``); a chunked prefill then starts after them."""
        pool = self.runner.pool
        if r.num_steps or r.num_computed or pool.row(r) is not None or not self._caches_prefix(r):
            return
        n, kv = self.prefix_cache.lookup(r.prompt_ids)
        if not n:
            return
        row = pool.reserve(r, "cond", r.num_tokens)
        for t, block in zip((*pool.keys, *pool.values), kv, strict=True):
            t[row, :, :n] = block
        r.num_cached = n
        if r.prefill_target:  # its chunks go on after the cached prefix
            r.num_computed = n
            r.prefill_chunk = min(r.prefill_chunk, max(0, r.prefill_target - n))

    def _store_prefix(self, r: Request) -> None:
        """After a request's first committed step (its prompt's keys/values are all in its KV row): store its
        prompt's full blocks past the cached prefix in the engine's prefix cache (``PrefixCache.insert``)."""
        if r.num_steps or not self._caches_prefix(r):
            return
        start, end = r.num_cached, r.answer_start // BLOCK_SIZE * BLOCK_SIZE
        if end > start:
            pool = self.runner.pool
            self.prefix_cache.insert_row(r.prompt_ids, pool.keys, pool.values, pool.row(r), start, end)

    def _history(self, batch: list[Request], settings: RowSettings, vocab: int, device: torch.device) -> History | None:
        """The rows' penalty history (``History.of``). Under next-token decoding with frequency or presence penalties
        only, each request's answer counts are kept and grow by the tokens committed since its last step (each adds
        1.0: the same counts, up to the first end id), not counted again over the whole answer every step. A request
        with DRY (only under next-token decoding: ``check_request``) adds its penalties after its committed tokens,
        the columns before its block (``celeris.sampling.dry``)."""
        dry = None  # the columns before its block are its committed tokens (no slices on the hot path without DRY)
        if any(r.dry is not None for r in batch):
            dry = row_penalties([r.dry for r in batch], [r.canvas[: r.block_span[0]] for r in batch])
        if not self.next_token or settings.any_penalty or not settings.any_count_penalty:
            history = History.of(settings, [r.canvas for r in batch], [r.answer for r in batch], vocab, self.mask_id,
                                 device, [r.ends(self.eos_id) for r in batch])
            return history if dry is None else replace(history or History(), dry=dry)
        counts = [self._answer_counts(r, vocab, device) for r in batch]
        return History(None, counts[0][None] if len(counts) == 1 else torch.stack(counts), dry)  # read, never written

    def _answer_counts(self, r: Request, vocab: int, device: torch.device) -> torch.Tensor:
        """(V,) float32 counts of r's committed answer tokens before its first end id (``answer_counts``' rule);
        next-token decoding commits the answer left to right, so positions [0, block start) are its tokens."""
        done = r.block_span[0] - r.answer_start
        counted, counts, ended = self._counts.get(r, (0, None, False))
        if counts is None or counts.numel() != vocab or done < counted:  # new, or its answer was reset
            counted, counts, ended = 0, torch.zeros(vocab, device=device), False
        if done > counted and not ended:
            ids, ends = r.answer[counted:done].tolist(), r.ends(self.eos_id)
            cut = next((j for j, t in enumerate(ids) if t in ends), None)
            if cut is not None:
                ids, ended = ids[:cut], True
            if ids:
                counts.index_add_(0, torch.tensor(ids, device=device), torch.ones(len(ids), device=device))
        self._counts[r] = (done, counts, ended)
        return counts

    def _settings_of(self, batch: list[Request], device: torch.device) -> RowSettings:
        """The rows' ``RowSettings``, made again only when the batch's requests changed (a step of the same requests
        reads the same settings: requests' ``params`` are not changed after admission)."""
        params = [r.params for r in batch]
        made = self._settings
        if made is None or len(made[0]) != len(params) or any(a is not b for a, b in zip(made[0], params, strict=True)):
            made = self._settings = (params, RowSettings.from_params(params, device))
        return made[1]

    def _record_logprobs(self, batch: list[Request], logits: torch.Tensor, new_block: torch.Tensor,
                         committed: torch.Tensor, settings: RowSettings, history: History | None,
                         allowed: torch.Tensor | None) -> None:
        """Store the log-probabilities of the tokens this step committed for the requests that ask
        (``celeris.sampling.logprobs.step_entries``, raw or processed as ``logprobs_mode`` says)."""
        rows = committed_entries(logits, new_block, committed, [r.params.logprobs for r in batch], settings,
                                 self.banned_ids, history, allowed, self.logprobs_mode)
        for r, row in zip(batch, rows, strict=True):
            offset = r.block_span[0] - r.answer_start
            r.logprob_entries.update({offset + c: e for c, e in row.items() if offset + c < r.params.max_tokens})

    @torch.no_grad()
    def passes(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """One denoising step's forward passes over ``requests``.

        Returns:
            logits (B, Lb, V) float32 for each request's current block (after CFG),
            and block (B, Lb) int64 current block tokens (columns past a short block
            hold the pad id, so they are never committed). Lb is the longest block.
        """
        for r in requests:  # (the rows of requests not among them were released by ``step``)
            if r.is_prefilling:  # its row, filled a chunk at a time by the window pass
                self.runner.pool.reserve(r, "cond", r.num_tokens)
        full = [i for i, r in enumerate(requests) if self._needs_full_pass(r)]
        windowed = sorted(set(range(len(requests))) - set(full))
        block_width = max(e - s for s, e in (r.block_span for r in requests))
        logits = block = None
        passes = [(rows, self._full_pass) for rows in self._full_groups(requests, full)]
        passes = [(rows, forward) for rows, forward in (*passes, (windowed, self._window_pass)) if rows]
        if len(passes) == 1:  # one pass over every row, in order: its logits as they are (not copied)
            return passes[0][1](requests, block_width)
        for rows, forward in passes:
            g_logits, g_block = forward([requests[i] for i in rows], block_width)
            if logits is None:
                logits = g_logits.new_empty((len(requests), block_width, g_logits.shape[-1]))
                block = g_block.new_empty((len(requests), block_width))
            logits[rows], block[rows] = g_logits, g_block
        return logits, block

    def _full_groups(self, requests: list[Request], rows: list[int]) -> list[list[int]]:
        """``rows`` (indices into ``requests``) split into groups of full passes that each pad little
        (``celeris.engine.path.pad_groups``: a full pass left-pads every row to its longest block start), each row's
        width its block start padded up to the length bucket, on a CPU (an accelerator keeps one pass)."""
        if self.runner.device.type != "cpu":  # an accelerator computes a padded batch in parallel: one pass
            return [rows] if rows else []
        bucket = self.runner.length_bucket
        return pad_groups({i: -(-(requests[i].block_span[0] + 1) // bucket) * bucket for i in rows})

    def _needs_full_pass(self, r: Request) -> bool:
        pool = self.runner.pool
        return not CACHE_MODES[r.params.cache].uses_cache or pool.row(r) is None or r.cache_columns() is None

    def _uncond(self, canvas: torch.Tensor, is_answer: torch.Tensor) -> torch.Tensor:
        """CFG's unconditional input: prompt and suffix replaced by the mask token."""
        return torch.where(is_answer, canvas, self.mask_id)

    def _block_tokens(self, requests: list[Request], block_width: int) -> torch.Tensor:
        """(B, block_width) tokens of each request's block, read from its own canvas; columns past a request's block
        hold the pad id (so they are never committed)."""
        block = torch.full((len(requests), block_width), self.pad_id, dtype=torch.long)
        for i, r in enumerate(requests):
            s, e = r.block_span
            block[i, : e - s] = r.canvas[s:e]
        return block

    def _guide(self, requests: list[Request], logits: torch.Tensor, cond: list[int], uncond: list[int]) -> torch.Tensor:
        """Rows ``cond`` of ``logits`` for every request, CFG applied to the guided ones (rows ``uncond``)."""
        # every pool row in order (no CFG row, the usual case): the logits as they are, not a copy of them
        out = logits if len(cond) == logits.shape[0] and cond == list(range(len(cond))) else logits[cond]
        guided_rows = [i for i, r in enumerate(requests) if r.params.cfg_scale > 0]
        if guided_rows:
            scale = torch.tensor([requests[i].params.cfg_scale for i in guided_rows], device=self.runner.device)
            scale = scale[:, None]
            out = out.clone()
            out[guided_rows] = guided(out[guided_rows], logits[uncond], scale)
        return out

    def _full_pass(self, requests: list[Request], block_width: int) -> tuple[torch.Tensor, torch.Tensor]:
        spans = [r.block_span for r in requests]
        align = max(s for s, _ in spans)  # every row's block starts at this column
        # a causal model's columns right of the block change nothing left of them (nor their keys/values): its full
        # pass stops at the block, the answer's later columns are computed a step at a time (window passes)
        right = block_width if self.next_token else max(r.num_tokens - s for r, (s, _) in zip(requests, spans,
                                                                                                 strict=True))
        total = align + max(right, block_width)
        total = -(-total // self.runner.length_bucket) * self.runner.length_bucket  # right padding up to a bucket
        offsets = [align - s for s, _ in spans]
        b = len(requests)
        canvas = torch.full((b, total), self.pad_id, dtype=torch.long)
        attn = torch.zeros((b, total), dtype=torch.bool)
        is_answer = torch.zeros((b, total), dtype=torch.bool)
        for i, (r, off) in enumerate(zip(requests, offsets, strict=True)):
            canvas[i, off : off + r.num_tokens] = r.canvas[: total - off]
            attn[i, off : off + r.visible_end] = True  # the rest of the canvas: past the suffix window
            is_answer[i, off + r.answer_start : off + r.answer_start + r.params.max_tokens] = True
        uncond_rows = [i for i, r in enumerate(requests) if r.params.cfg_scale > 0]
        batch_ids = torch.cat([canvas, self._uncond(canvas, is_answer)[uncond_rows]]).to(self.runner.device)
        batch_attn = torch.cat([attn, attn[uncond_rows]]).to(self.runner.device)
        caching = any(r.params.cache != "none" for r in requests)
        cache = KVCache() if caching else None
        kwargs = {} if cache is None else {"cache": cache}
        columns = slice(align, align + block_width)
        logits = self.runner.model(batch_ids, batch_attn, logits_slice=columns, **kwargs)  # (B + C, Lb, V)
        if cache is not None:
            sources = [(r, "cond") for r in requests] + [(requests[i], "uncond") for i in uncond_rows]
            for row, ((r, kind), off) in enumerate(zip(sources, offsets + [offsets[i] for i in uncond_rows], strict=True)):
                if r.params.cache != "none":
                    cols = slice(off, off + r.num_tokens)  # a causal model's: up to its block (the rest later)
                    self.runner.pool.store(r, kind, [k[row, :, cols] for k in cache.keys],
                                           [v[row, :, cols] for v in cache.values])
                    self.runner.pool.reserve(r, kind, r.num_tokens)  # window passes see the whole canvas
        logits = self._guide(requests, logits, list(range(b)), list(range(b, b + len(uncond_rows))))
        return logits, self._block_tokens(requests, block_width).to(self.runner.device)

    def _window_pass(self, requests: list[Request], block_width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One window pass over every live pool row, or two when a few rows need far more columns than the rest.

        Per-row columns are padded to the widest row, so one row at a ``dual_delayed`` (or ``prefix``)
        block start, which recomputes the whole masked suffix, would make every other row compute that
        many columns too; with continuous batching (requests out of phase) or threshold decoding (blocks
        of different lengths in steps) that happens at almost every step. So when at most half the rows
        are wider than twice the block ("wide"), those first redo only their block in the shared pass,
        then run alone on a copy of their pool rows, which is written back (their block's keys/values are
        recomputed there, so the first pass's are never read).
        """
        pool = self.runner.pool
        rows, total = pool.num_rows, pool.capacity_length
        canvas = torch.full((rows, total), self.pad_id, dtype=torch.long)
        attn = torch.zeros((rows, total), dtype=torch.bool)
        columns, block_starts = [], []
        for row, (r, kind) in enumerate(pool.owners):
            n = r.num_tokens
            ids = r.canvas
            if kind == "uncond":
                is_answer = torch.zeros(n, dtype=torch.bool)
                is_answer[r.answer_start : r.answer_start + r.params.max_tokens] = True
                ids = self._uncond(ids, is_answer)
            canvas[row, :n] = ids
            attn[row, : r.visible_end] = True
            # a row that ran a full pass this step just redoes its block; a prefilling row computes its chunk
            if r.is_prefilling:  # paused (a chunk of 0): redo a column it holds (column 0 is exact on its own)
                first = r.num_computed if r.prefill_chunk else max(r.num_computed - 1, 0)
                cols, block_start = list(range(first, r.num_computed + r.prefill_chunk) or [first]), 0
            else:
                cols, block_start = r.cache_columns() or (list(range(*r.block_span)), 0)
                if self.next_token:
                    cols, block_start = self._next_token_columns(r, cols)
            columns.append(cols)
            block_starts.append(block_start)
        wide = [row for row, c in enumerate(columns) if len(c) > 2 * block_width]
        if not wide or 2 * len(wide) > rows:  # splitting pays (and copies at most half the pool) when few are wide
            logits = self._run_window(canvas, attn, pool.view(), columns, block_starts, block_width)
        else:
            shared, shared_starts = list(columns), list(block_starts)
            for row in wide:  # in the shared pass a wide row only redoes its block (a prefill: its chunk's first)
                r = pool.owners[row][0]
                shared[row] = [r.num_computed] if r.is_prefilling else list(range(*r.block_span))
                shared_starts[row] = 0
            logits = self._run_window(canvas, attn, pool.view(), shared, shared_starts, block_width)
            self.runner.num_split_passes += 1
            idx = torch.tensor(wide, device=self.runner.device)
            sub = KVCache([k.index_select(0, idx) for k in pool.keys], [v.index_select(0, idx) for v in pool.values])
            logits[idx] = self._run_window(canvas[wide], attn[wide], sub, [columns[i] for i in wide],
                                           [block_starts[i] for i in wide], block_width)
            for layer in range(len(pool.keys)):
                pool.keys[layer].index_copy_(0, idx, sub.keys[layer])
                pool.values[layer].index_copy_(0, idx, sub.values[layer])
        cond = [pool.row(r) for r in requests]
        uncond = [pool.row(r, "uncond") for r in requests if r.params.cfg_scale > 0]
        logits = self._guide(requests, logits, cond, uncond)
        return logits, self._block_tokens(requests, block_width).to(self.runner.device)

    @staticmethod
    def _next_token_columns(r: Request, cols: list[int]) -> tuple[list[int], int]:
        """A causal model's window columns without its block column t, with t - 1 (whose hidden state scores t),
        and where t - 1 is among them.

        Exact: a causal model decodes with ``block_length`` 1 under the ``delayed`` cache (or none, which runs full
        passes; ``celeris.sampling.modes.check_masked_support``), so no column of this pass attends to t (causal
        attention looks left) and the next step rewrites t's keys/values as a stale column before any pass reads
        them; the mask column is the one the two-column window computed for nothing (it halves the columns of a
        decoding step, which matters most for the quantized kernels, whose cost grows with the columns).
        """
        t = r.block_span[0]
        kept = sorted((set(cols) - {t}) | {t - 1})
        return kept, kept.index(t - 1)

    def _run_window(self, canvas: torch.Tensor, attn: torch.Tensor, cache: KVCache, columns: list[list[int]],
                    block_starts: list[int], block_width: int) -> torch.Tensor:
        """A window pass: row i computes canvas columns ``columns[i]`` and scores the ``block_width`` of them from
        ``block_starts[i]`` on. canvas/attn (R, T) on the CPU, cache rows (R, ...). Returns (R, Lb, V) logits."""
        cols = column_window(columns)  # (R, Lw)
        width = torch.tensor([len(c) for c in columns])[:, None]
        index = torch.minimum(torch.tensor(block_starts)[:, None] + torch.arange(block_width)[None], width - 1)  # (R, Lb)
        if self.next_token:  # the hidden state at each row's chosen column scores its next token (no shift)
            hidden = self.runner.hidden_states(canvas.to(self.runner.device), attn.to(self.runner.device), cache,
                                               cols.to(self.runner.device))
            return self.runner.logits(gather_positions(hidden, index.to(self.runner.device)))
        return self.runner.model(canvas.to(self.runner.device), attn.to(self.runner.device), cache=cache,
                          window=cols.to(self.runner.device), logits_index=index.to(self.runner.device))
