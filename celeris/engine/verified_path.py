"""The verified path of the engine, ``VerifiedPath``: its requests' rows in one ``VerifiedDecoder``
(``celeris.engine.verified``), each request's cursor (``request.state``) a ``DraftRow``; the engine's scheduler
asks it for the columns and KV rows its requests take."""

from __future__ import annotations

import torch

from celeris.engine.draft_rows import DraftRow
from celeris.engine.path import PathContext
from celeris.engine.verified import VerifiedDecoder
from celeris.sampling.verified import MAX_DRAFTS


class VerifiedPath:
    """Runs the verified-decoding passes of the engine's requests: each request's ``DraftRow`` is its
    ``request.state``; the ``VerifiedDecoder`` (its rows of the engine's KV store) is made at the first verified
    request.

    Args:
        context: the engine's shared parts (``celeris.engine.path.PathContext``): the (causal) model, the runner
            whose entries a pass calls, the engine's ``EngineConfig`` (``max_num_seqs``, ``enable_prefix_caching``,
            ``logprobs_mode``), ``max_model_len`` (the tokens a pool row holds) and the end-of-text id.
    """

    mode = "verified"

    def __init__(self, context: PathContext) -> None:
        self.model, self.config = context.model, context.config
        self.max_model_len, self.eos_id = context.max_model_len, context.eos_id
        self.entry = context.runner  # the engine's runner (its compiled entries)
        self.decoder: VerifiedDecoder | None = None

    def release(self) -> None:
        """Free the pool rows of finished or aborted requests."""
        if self.decoder is not None:
            for row in [row for row in self.decoder.rows if row.owner is None or row.owner.is_finished]:
                self._remove(row)

    def _remove(self, row: DraftRow) -> None:
        self.decoder.remove(row)
        if row.owner is not None:
            row.owner.state = None

    @staticmethod
    def pending_drafts(request: object) -> list[int]:
        """The drafts the request's next pass checks; [] before its first pass and after its last."""
        row = request.state
        return list(row.drafts) if isinstance(row, DraftRow) and not row.finished else []

    def kv_rows(self, request: object) -> int:
        """Rows of the KV store a request takes: one (its committed tokens', drafts' and slots' keys/values)."""
        return 1

    def token_cost(self, requests: list) -> int:
        """Columns the next passes over ``requests`` compute (the scheduler's budget): a new request's prefill is
        its prompt and its drafts (at most ``MAX_DRAFTS`` columns for drafts and as many for slots), or, prefilling
        in chunks, this step's chunk (``Request.prefill_chunk``), and once its chunks are done its
        ``DraftRow.columns``, as a running one's; prefill and decode are two passes, each padded to its widest row."""
        new, running = [], []
        for r in requests:
            row = r.state if isinstance(r.state, DraftRow) else None
            if row is not None and row.passes:
                running.append(len(row.columns))
            else:  # a prefill: this step's chunk, or its row's columns once its chunks are done, or all of it
                new.append(r.prefill_chunk if r.is_prefilling else len(row.columns) if row is not None
                           else len(r.prompt_ids) + 2 * MAX_DRAFTS)
        return sum(len(group) * max(group) for group in (new, running) if group)

    def prefill_columns(self, request: object) -> int:
        """Prompt columns a chunked prefill can compute ahead of the first pass: all but the last (whose logits
        the first pass reads); with a DFlash drafter, each chunk's target features are queued for its context."""
        return len(request.prompt_ids) - 1

    def step(self, batch: list) -> list:
        """One pass for ``batch`` (running verified requests): new requests are prefilled (a chunk of a long
        prompt, under chunked prefill), the others advance by their accepted drafts plus one token; committed
        tokens are final at once. Returns the requests that advanced (``batch`` less those prefilling)."""
        if self.decoder is None:
            # the store's prefix cache serves (the engine made it from ``enable_prefix_caching``)
            self.decoder = VerifiedDecoder(self.model, self.config.max_num_seqs, self.max_model_len,
                                           entry=self.entry, store=self.entry.kv)
            self.decoder.logprobs_mode = self.config.logprobs_mode
        running = set(batch)
        for row in [row for row in self.decoder.rows if row.owner not in running or row.owner.is_finished]:
            self._remove(row)
        for request in batch:
            if request.state is None:
                request.state = self.decoder.add(request.prompt_ids, request.params, request.ends(self.eos_id),
                                                 request.constraint)
                request.state.owner = request
            if request.prefill_target:  # a prefix cache hit counts as prefilled too
                request.num_computed = max(request.num_computed, request.state.num_cached)
            request.state.plan_chunk(request.prefill_target, request.prefill_chunk)
        committed = {id(row): new for row, new in self.decoder.step()}
        for request in (prefilled := [r for r in batch if r.is_prefilling]):  # a chunk is in its row; no commit
            request.nfe += request.state.num_cached > request.num_computed
            request.num_computed = request.state.num_cached
        batch = [r for r in batch if r not in prefilled]
        for request in batch:
            row = request.state
            new = committed.get(id(row), [])
            start = request.answer_start + len(row.answer) - len(new)
            request.canvas[start : start + len(new)] = torch.tensor(new, dtype=torch.long)
            if new and row.params.logprobs is not None:  # the entries of this pass's tokens (``DraftRow``)
                first = len(row.answer) - len(new)
                request.logprob_entries.update({first + j: e for j, e in enumerate(row.new_logprobs[: len(new)])})
            request.record_step()
            request.drafter_passes = row.draft_state.calls if row.draft_state is not None else 0
            if row.finished:
                # "stop": an end id, or a grammar that allows nothing more (row.hit_eos)
                done = row.hit_eos or not request.ends(self.eos_id).isdisjoint(row.answer)
                request.finish("stop" if done else "length")
                self._remove(row)
        return batch
