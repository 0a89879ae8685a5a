"""The masked-diffusion sampler: a plain function of (model, prompt ids, params).

Semi-autoregressive remasking (LLaDA arXiv:2502.09992, Sec. 2.4 and App. B):
the answer starts fully masked and is denoised block by block, left to right.
At every denoising step the model predicts all positions at once; a commit
rule (``celeris.sampling.rules.COMMIT_RULES``) decides which masked positions
of the current block take their prediction, the rest stay masked. Committed
tokens never change.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from celeris.models.layers import KVCache, column_window
from celeris.reference.block import generate_block
from celeris.sampling.block import answer_ends
from celeris.sampling.cache import CACHE_MODES, cache_window, visible_end
from celeris.sampling.modes import check_request, mode_of
from celeris.sampling.output import GenerationOutput, answer_done, build_canvas, cut_at_eos
from celeris.sampling.params import SamplingParams
from celeris.sampling.schedule import block_plan, num_transfer_tokens
from celeris.sampling.step import (
    History,
    NoProgressError,
    RowSettings,
    banned_token_ids,
    check_prompts,
    commit_step,
    confidence_rule,
    guided,
    make_generator,
)
from celeris.structured.grammar import row_constraints


def batch_rows(prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[SamplingParams]:
    """One SamplingParams per prompt (``params`` repeated when it is one).

    Raises:
        ValueError: no prompt, an empty prompt, a params list of another length, or rows that differ in a setting
            they must share (``SamplingParams.structure_key``).
    """
    rows = params if isinstance(params, list) else [params] * len(prompt_ids)
    if len(rows) != len(prompt_ids) or not prompt_ids:
        raise ValueError("need one SamplingParams per prompt and at least one prompt")
    check_prompts(prompt_ids)
    if len({r.structure_key() for r in rows}) > 1:
        raise ValueError("rows of one batch must share max_tokens, steps, block_length, remasking, decoding "
                         "and cache settings")
    return rows


def delayed_columns(
    stale: list[list[int]], span: slice, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row window of a ``rewrites_stale`` cache at a block's first step: each row's stale columns
    (committed at its previous block's last step, so their cached keys/values were computed
    while they were still masked: dKV-Cache's one-step delayed caching, arXiv:2505.15781),
    then the block. Returns the (B, Lw) columns, padded by repeating the block's last column,
    and the (B, L) index of the block's columns inside them."""
    block = list(range(span.start, span.stop))
    index = [[len(s) + j for j in range(len(block))] for s in stale]
    return column_window([s + block for s in stale], device), torch.tensor(index, device=device)


def cache_args(cache: KVCache | None, window: tuple[int, int] | torch.Tensor | None) -> dict:
    """Keyword arguments for the model: fill ``cache`` (window None) or read it (window given)."""
    return {} if cache is None else {"cache": cache, "window": window}


def _pass_layout(
    params: SamplingParams, attn: torch.Tensor, blocks: list[tuple[int, int]], block_idx: int, answer_start: int,
    step_in_block: int, last_commit: list[list[int]],
) -> tuple[torch.Tensor, tuple[int, int] | torch.Tensor | None, dict]:
    """What this step's passes see and compute: the (B, T) bool attention mask (cut at ``visible_end`` under a
    ``suffix_window``), the cache window (``celeris.sampling.cache``; None: a full pass; per-row columns at a
    block's first step under a policy that ``rewrites_stale``) and the model's output-position keyword."""
    total = attn.shape[1]
    span = slice(answer_start + blocks[block_idx][0], answer_start + blocks[block_idx][1])
    visible = visible_end(total, span.stop, params.suffix_window)
    step_attn = attn  # (B, T) bool: the columns this step's passes attend to
    if visible < total:
        step_attn = attn & (torch.arange(total, device=attn.device) < visible)
    window = cache_window(params.cache, blocks, block_idx, answer_start, visible, step_in_block, params.cache_refresh)
    if CACHE_MODES[params.cache].rewrites_stale and step_in_block == 0 and window is not None:
        window, index = delayed_columns(last_commit, span, attn.device)
        return step_attn, window, {"logits_index": index}
    return step_attn, window, {"logits_slice": span}


def _forward(
    model: torch.nn.Module, canvas: torch.Tensor, step_attn: torch.Tensor, outputs: dict,
    caches: tuple[KVCache | None, KVCache | None], window: tuple[int, int] | torch.Tensor | None,
    is_prompt: torch.Tensor, settings: RowSettings,
) -> tuple[torch.Tensor, int]:
    """The step's (B, L, V) logits of the block and the number of forward passes: one, or two under
    classifier-free guidance (a second, unconditional pass with the prompt and suffix masked, on its own cache)."""
    logits = model(canvas, step_attn, **outputs, **cache_args(caches[0], window))  # (B, L, V)
    if not settings.any_cfg:
        return logits, 1
    uncond = model(canvas.masked_fill(is_prompt, model.config.mask_token_id), step_attn, **outputs,
                   **cache_args(caches[1], window))
    return guided(logits, uncond, settings.cfg_scale), 2


def _first_tokens(answer: torch.Tensor, mask_id: int, ttft_s: list[float | None], now: float) -> None:
    """Record ``now`` for the rows whose answer position 0 became final at this step."""
    for i in (answer[:, 0] != mask_id).nonzero().flatten().tolist():
        if ttft_s[i] is None:
            ttft_s[i] = now


def _check_masked(model: torch.nn.Module, params: SamplingParams, has_suffix: bool) -> None:
    """``check_request``, and a ValueError naming ``decoding`` for a mode this sampler does not run (verified
    decoding, a plug-in's: the engine's paths run them)."""
    mode = check_request(model, params, has_suffix)
    if mode != "masked":
        raise ValueError(f"decoding '{params.decoding}' is the {mode} mode, which this reference sampler does not run "
                         f"(masked and block diffusion only); decode it through the engine (LLM.generate)")


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    suffix_ids: list[list[int]] | None = None,
    on_step: Callable[[torch.Tensor], None] | None = None,
    grammar_tokenizer: object | None = None,
) -> GenerationOutput:
    """Generate answers for a batch of prompts by masked diffusion.

    Args:
        model: maps (B, T) ids + (B, T) bool attention mask to logits; must
            accept ``logits_slice`` and have ``config.mask_token_id``,
            ``eos_token_id`` and ``pad_token_id``.
        prompt_ids: B non-empty lists of token ids (lengths may differ; rows are
            left-padded and padding is never attended).
        params: one SamplingParams for all rows, or one per row. Rows may differ
            in temperature, top_p, top_k, seed, stop and cfg_scale only; the rest must
            match (``SamplingParams.structure_key``).
        suffix_ids: optional per-row text after the gap (infilling).
        on_step: called after every step with the (B, max_tokens) answer canvas.
        grammar_tokenizer: llguidance's tokenizer (``celeris.structured.grammar_tokenizer``), needed when a
            row has a ``grammar``: such a row commits, left to right, the longest run of its step's committed
            proposals from the block's leftmost open position that the grammar accepts, at least that position's
            grammar-masked token (``celeris.structured.grammar.constrain_commits``), and, once its grammar is
            complete, only the end-of-text token.

    Raises:
        ValueError: empty prompt, mismatched structural settings, or settings the model cannot
            do (``celeris.sampling.modes.check_request``: e.g. blocks longer than 1 on a causal model), or a
            request of a mode other than masked or block diffusion (``verified``, a plug-in's).
        NoProgressError: a step committed nothing for a row (non-finite scores).
    """
    first = params[0] if isinstance(params, list) and params else params
    if isinstance(first, SamplingParams) and mode_of(model, first) == "block":  # block diffusion's reference
        if suffix_ids and any(suffix_ids):
            raise ValueError("suffix (infilling) needs a full-attention model: a block model never sees what follows")
        step_hook = (lambda _row, answer: on_step(answer[None])) if on_step is not None else None  # (1, N) per row
        return generate_block(model, prompt_ids, params, on_step=step_hook)
    start = time.perf_counter()
    rows = batch_rows(prompt_ids, params)
    first = rows[0]  # the settings all rows share (structure_key)
    config = model.config
    device = next(model.parameters()).device
    mask_id, eos_id = config.mask_token_id, config.eos_token_id
    canvas, attn, is_prompt, answer_start = build_canvas(
        prompt_ids, first.max_tokens, mask_id, config.pad_token_id, suffix_ids, device
    )
    batch = canvas.shape[0]
    settings = RowSettings.from_params(rows, device)
    generators = [make_generator(r.seed) for r in rows]
    banned = banned_token_ids(config)
    _check_masked(model, first, any(suffix_ids or []))
    constraints = row_constraints(rows, grammar_tokenizer)
    blocks, steps_per_block = block_plan(first.max_tokens, first.block_length, first.steps)
    policy = CACHE_MODES[first.cache]
    caches = (KVCache(), KVCache()) if policy.uses_cache else (None, None)
    nfe = steps = 0
    ttft_s: list[float | None] = [None] * batch
    last_commit: list[list[int]] = [[] for _ in range(batch)]  # per row: columns its latest committing step filled
    for block_idx, (s, e) in enumerate(blocks):
        span = slice(answer_start + s, answer_start + e)
        block_steps = min(steps_per_block, e - s)
        schedule = num_transfer_tokens((canvas[:, span] == mask_id).sum(-1), block_steps)  # (B, S)
        step_in_block = 0
        while bool((canvas[:, span] == mask_id).any()):
            step_attn, window, outputs = _pass_layout(first, attn, blocks, block_idx, answer_start, step_in_block,
                                                    last_commit)
            logits, passes = _forward(model, canvas, step_attn, outputs, caches, window, is_prompt, settings)
            nfe += passes
            history = History.of(settings, list(torch.where(attn, canvas, mask_id)),  # padding is not context
                                 list(canvas[:, answer_start : answer_start + first.max_tokens]), logits.shape[-1],
                                 mask_id, device, [answer_ends(r, [eos_id]) for r in rows])
            step = commit_step(logits, canvas[:, span].clone(), mask_id, eos_id, banned,
                               schedule[:, min(step_in_block, block_steps - 1)], settings, generators, history,
                               confidence_from=confidence_rule(model), constraints=constraints,
                               left=[first.max_tokens - s] * batch)
            canvas[:, span], committed = step.block, step.committed
            if bool(step.stalled.any()):
                raise NoProgressError(f"denoising step {steps + 1} committed no token (the model's scores are not "
                                      f"finite numbers)")
            for i in committed.any(-1).nonzero().flatten().tolist():
                last_commit[i] = (span.start + committed[i].nonzero().flatten()).tolist()
            steps += 1
            step_in_block += 1
            answer = canvas[:, answer_start : answer_start + first.max_tokens]
            _first_tokens(answer, mask_id, ttft_s, time.perf_counter() - start)
            if on_step is not None:
                on_step(answer)
        if first.early_exit and bool(answer_done(canvas[:, answer_start : answer_start + e], eos_id, mask_id).all()):
            break
    answer = canvas[:, answer_start : answer_start + first.max_tokens]
    return GenerationOutput(
        answer_ids=answer.cpu(),
        token_ids=cut_at_eos(answer.cpu(), eos_id, mask_id),
        nfe=nfe,
        steps=steps,
        ttft_s=ttft_s,
        seconds=time.perf_counter() - start,
    )
