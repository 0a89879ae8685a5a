"""The block-diffusion reference sampler: ``generate_block`` recomputes the whole canvas up to the current block's
end under the contract's layout mask at every step, one row at a time (no KV cache).

The rules it follows (sub-blocks, schedules, the first token committed alone, early exit) are
``celeris.sampling.block``'s, shared with the engine's block path (``celeris.engine.blocks``), which must give the
same tokens (``tests/engine/test_blocks.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from celeris.models.contract import DecodingContract, layout_mask
from celeris.sampling.block import (
    Unit,
    answer_ends,
    block_steps,
    block_units,
    check_block_support,
    contract_of,
    end_reached,
    first_token_pending,
    unit_schedule,
    with_block_defaults,
)
from celeris.sampling.output import GenerationOutput
from celeris.sampling.params import SamplingParams
from celeris.sampling.step import (
    History,
    NoProgressError,
    RowSettings,
    banned_token_ids,
    commit_step,
    confidence_rule,
    make_generator,
)


def _unit_logits(model: torch.nn.Module, contract: DecodingContract, canvas: torch.Tensor, unit: Unit,
                 origin: torch.Tensor, width: int) -> torch.Tensor:
    """(1, width, V) logits of canvas columns [s, s + width) of ``unit`` = (a, e, s, t): the whole canvas up to the
    block's end ``e`` recomputed under the contract's layout mask (nothing after ``e``); row i scores column
    s + i (from the hidden state ``logits_shift`` columns to its left). ``canvas`` (T,) int64; ``origin`` (1,)."""
    a, e, s, _ = unit
    cols = torch.arange(e, device=canvas.device)[None]
    mask = layout_mask(cols, e, torch.tensor([a], device=canvas.device), torch.tensor([e], device=canvas.device),
                       origin, contract.block_size, contract.attention)
    hidden = model.hidden_states(canvas[None, :e], layout_mask=mask)  # (1, e, d)
    shift = model.logits_shift
    return model.logits(hidden[:, s - shift : s - shift + width])


@torch.no_grad()
def generate_block(
    model: torch.nn.Module,
    prompt_ids: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    end_ids: list[int] | None = None,
    on_step: Callable[[int, torch.Tensor], None] | None = None,
) -> GenerationOutput:
    """Generate answers with a block-diffusion model, recomputing everything at every step (the reference).

    Args:
        model: a model with ``block_contract`` whose ``hidden_states(ids, layout_mask=...)`` and ``logits``
            follow ``TransformerLM``.
        prompt_ids: B non-empty prompts (each row is decoded on its own).
        params: one SamplingParams for all rows, or one per row (rows may differ in anything).
        end_ids: ids that end an answer (default: the config's end-of-text id).
        on_step: called after every step with (row, (max_tokens,) answer canvas).

    Returns:
        ``celeris.sampling.output.GenerationOutput``; ``nfe`` sums every row's forward passes, ``steps`` too.

    Raises:
        ValueError: empty prompt or a setting the model cannot use (``check_block_support``).
        NoProgressError: a step committed nothing (non-finite scores).
    """
    start = time.perf_counter()
    rows = params if isinstance(params, list) else [params] * len(prompt_ids)
    rows = [with_block_defaults(model, sp) for sp in rows]
    if len(rows) != len(prompt_ids) or not prompt_ids or any(not p for p in prompt_ids):
        raise ValueError("need one SamplingParams per prompt and non-empty prompts")
    contract = contract_of(model)
    cfg = model.config
    mask_id = cfg.mask_token_id
    device = next(model.parameters()).device
    banned = banned_token_ids(cfg)
    answers, cut, ttft_s = [], [], []
    nfe = 0
    for row, (prompt, sp) in enumerate(zip(prompt_ids, rows, strict=True)):
        check_block_support(contract, sp)
        ends = answer_ends(sp, end_ids if end_ids is not None else [cfg.eos_token_id])
        settings = RowSettings.from_params([sp], device)
        generator = make_generator(sp.seed)
        p, n = len(prompt), sp.max_tokens
        context = getattr(cfg, "max_position_embeddings", None)
        units = block_units(p, n, contract, sp.block_length, context)
        canvas = torch.full((units[-1][1],), mask_id, dtype=torch.long, device=device)  # padded to a whole block
        canvas[:p] = torch.tensor(prompt, dtype=torch.long, device=device)
        origin = torch.tensor([0 if contract.alignment == "absolute" else p], device=device)
        first: float | None = None  # seconds to the answer's first committed token
        for unit in units:
            a, e, s, t = unit
            schedule, num_steps = unit_schedule(block_steps(contract, sp), sp.block_length)
            schedule = schedule.to(device)
            step = 0
            while bool((canvas[s:t] == mask_id).any()):
                pending = first_token_pending(contract, unit, canvas, mask_id)
                hi = s + 1 if pending else t  # a pending first token is committed alone, before the sub-block
                logits = _unit_logits(model, contract, canvas, unit, origin, hi - s)  # (1, L, V)
                nfe += 1
                history = History.of(settings, [canvas], [canvas[p : p + n]], logits.shape[-1], mask_id, device, [ends])
                block = canvas[s:hi].clone()
                k = torch.ones(1, dtype=torch.long, device=device) if pending else \
                    schedule[min(step, num_steps - 1)].reshape(1)
                force = torch.ones((1, 1), dtype=torch.bool, device=device) if pending else None
                step_commit = commit_step(logits, block[None], mask_id, cfg.eos_token_id, banned, k, settings,
                                          [generator], history, confidence_from=confidence_rule(model), force=force)
                if bool(step_commit.stalled.any()):
                    raise NoProgressError(f"denoising step {step + 1} committed no token (the model's scores are "
                                          f"not finite numbers)")
                new = step_commit.block
                canvas[s:hi] = new[0]
                step += 0 if pending else 1
                if first is None and int(canvas[p]) != mask_id:
                    first = time.perf_counter() - start
                if on_step is not None:
                    on_step(row, canvas[p : p + n])
                if sp.early_exit and end_reached(canvas[p : p + n].tolist(), ends, mask_id):
                    break
            if sp.early_exit and end_reached(canvas[p : p + n].tolist(), ends, mask_id):
                break
        answer = canvas[p : p + n].cpu()
        ids = answer.tolist()
        stop = next((i for i, tok in enumerate(ids) if tok in ends or tok == mask_id), len(ids))
        answers.append(answer)
        cut.append(ids[:stop])
        ttft_s.append(first)
    width = max(a.numel() for a in answers)  # rows may differ in max_tokens: padded with the mask id
    padded = torch.stack([torch.cat([a, a.new_full((width - a.numel(),), mask_id)]) for a in answers])
    return GenerationOutput(answer_ids=padded, token_ids=cut, nfe=nfe, steps=nfe, ttft_s=ttft_s,
                            seconds=time.perf_counter() - start)
