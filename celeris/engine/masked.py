"""The engine's masked-diffusion path: one denoising step for every running masked request.

The runner (``celeris.engine.runner.ModelRunner``) makes the step's passes (a full pass and a window pass over
its KV pool) and returns each request's block logits; this path commits them through
``celeris.sampling.step.commit_step`` (the reference sampler's composition: grammar, commit rule, grammar
correction, progress check), stores the committed tokens' log-probabilities when asked, and moves each request's
cursor (``Request.advance``: the block, its schedule) or ends it. A request's cursor is the ``Request`` itself
(``request.state`` stays None).
"""

from __future__ import annotations

import torch

from celeris.engine.request import NO_PROGRESS, Request
from celeris.engine.runner import ModelRunner
from celeris.sampling.logprobs import step_entries
from celeris.sampling.step import RowSettings, commit_step, context_tokens, prepare_logits


class MaskedPath:
    """Runs the masked-diffusion steps of the engine's requests (module docstring).

    Args:
        runner: the engine's model runner (its passes and KV pool).
        mask_id / eos_id / banned_ids / confidence_from: the model's ids and its confidence rule
            (``celeris.sampling.step.confidence_rule``).
        logprobs_mode: ``EngineConfig.logprobs_mode`` ("raw_logprobs" or "processed_logprobs").
    """

    mode = "masked"

    def __init__(self, runner: ModelRunner, mask_id: int, eos_id: int, banned_ids: list[int], confidence_from: str,
                 logprobs_mode: str = "raw_logprobs") -> None:
        self.runner = runner
        self.mask_id, self.eos_id, self.banned_ids = mask_id, eos_id, banned_ids
        self.confidence_from = confidence_from
        self.logprobs_mode = logprobs_mode

    def release(self) -> None:
        """Free the KV rows of finished or aborted requests."""
        self.runner.release({r for r, _ in self.runner.pool.owners if not r.is_finished})

    @torch.no_grad()
    def step(self, batch: list[Request]) -> list[Request]:
        """One denoising step for ``batch`` (running masked requests): commit, count (``Request.record_step``),
        advance or finish each. Returns ``batch``."""
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
        if any(r.params.logprobs is not None for r in batch):  # asking for nothing costs nothing
            self._record_logprobs(batch, logits, step.block, step.committed, settings, seen, step.allowed)
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
            self.runner.release({r for r in batch if not r.is_finished})
        return batch

    def _record_logprobs(self, batch: list[Request], logits: torch.Tensor, new_block: torch.Tensor,
                         committed: torch.Tensor, settings: RowSettings, seen: torch.Tensor | None,
                         allowed: torch.Tensor | None) -> None:
        """Store the log-probabilities of the tokens this step committed for the requests that ask
        (``celeris.sampling.logprobs.step_entries``, raw or processed as ``logprobs_mode`` says)."""
        processed = None
        if self.logprobs_mode == "processed_logprobs":
            processed, _ = prepare_logits(logits, settings, self.banned_ids, seen, allowed)
        rows = step_entries(logits, new_block, committed, [r.params.logprobs for r in batch], processed,
                            settings.temperature)
        for r, row in zip(batch, rows, strict=True):
            offset = r.block_span[0] - r.answer_start
            r.logprob_entries.update({offset + c: e for c, e in row.items() if offset + c < r.params.max_tokens})
