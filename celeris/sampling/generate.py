"""The masked-diffusion sampler: a plain function of (model, prompt ids, params).

Semi-autoregressive remasking (LLaDA arXiv:2502.09992, Sec. 2.4 and App. B):
the answer starts fully masked and is denoised block by block, left to right.
At every denoising step the model predicts all positions at once; a commit
rule (``celeris.sampling.select.COMMIT_RULES``) decides which masked positions
of the current block take their prediction, the rest stay masked. Committed
tokens never change.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from celeris.models.celeris import KVCache
from celeris.models.layers import column_window
from celeris.params import SamplingParams
from celeris.sampling.schedule import block_plan, num_transfer_tokens
from celeris.sampling.step import (
    NoProgressError,
    RowSettings,
    banned_token_ids,
    check_model_support,
    confidence_rule,
    context_tokens,
    denoise_step,
    guided,
    make_generator,
)
from celeris.structured.grammar import constrain_commits, grammar_step, row_constraints


@dataclass(slots=True)
class GenerationOutput:
    """Result of one batched sampler call.

    Attributes:
        answer_ids: (B, max_new_tokens) int64 final canvas of the answer span
            (positions never reached by early exit hold the mask id).
        token_ids: per row, the answer cut before the first end-of-text token.
        nfe: forward passes of the model (a CFG step counts as 2).
        steps: denoising steps run.
        first_token_s: per row, seconds from the call's start until answer
            position 0 was final (time to first token), or None.
        seconds: wall time of the call.
    """

    answer_ids: torch.Tensor
    token_ids: list[list[int]]
    nfe: int
    steps: int
    first_token_s: list[float | None] = field(default_factory=list)
    seconds: float = 0.0


def build_canvas(
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    mask_id: int,
    pad_id: int,
    suffix_ids: list[list[int]] | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Lay out [left padding | prompt | masked answer | suffix | right padding] for each row.

    Returns:
        canvas (B, T) int64, attention_mask (B, T) bool (False on padding),
        is_prompt (B, T) bool (prompt and suffix tokens, masked out by CFG's
        unconditional pass), and the answer's start column.
    """
    b = len(prompt_ids)
    suffix_ids = suffix_ids or [[] for _ in range(b)]
    lp = max(len(p) for p in prompt_ids)
    ls = max(len(s) for s in suffix_ids)
    total = lp + max_new_tokens + ls
    canvas = torch.full((b, total), pad_id, dtype=torch.long)
    attn = torch.zeros((b, total), dtype=torch.bool)
    for i, (p, s) in enumerate(zip(prompt_ids, suffix_ids, strict=True)):
        canvas[i, lp - len(p) : lp] = torch.tensor(p, dtype=torch.long)
        canvas[i, lp : lp + max_new_tokens] = mask_id
        canvas[i, lp + max_new_tokens : lp + max_new_tokens + len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, lp - len(p) : lp + max_new_tokens + len(s)] = True
    is_prompt = attn.clone()
    is_prompt[:, lp : lp + max_new_tokens] = False
    return canvas.to(device), attn.to(device), is_prompt.to(device), lp


def cut_at_eos(answer: torch.Tensor, eos_id: int, mask_id: int) -> list[list[int]]:
    """Rows of (B, N) answer ids cut before the first end-of-text (and any never-filled mask)."""
    rows = []
    for row in answer.tolist():
        for stop_id in (eos_id, mask_id):
            if stop_id in row:
                row = row[: row.index(stop_id)]
        rows.append(row)
    return rows


def answer_done(answer: torch.Tensor, eos_id: int, mask_id: int) -> torch.Tensor:
    """(B, N) -> (B,) bool: the answer holds an end-of-text token and nothing before it is masked."""
    is_eos = answer == eos_id
    first_eos = torch.where(is_eos.any(-1), is_eos.long().argmax(-1), answer.shape[1])  # (B,)
    cols = torch.arange(answer.shape[1], device=answer.device)
    masked_before = ((answer == mask_id) & (cols[None] < first_eos[:, None])).any(-1)
    return is_eos.any(-1) & ~masked_before


def visible_end(total: int, block_end: int, suffix_window: int) -> int:
    """Canvas columns [0, visible_end) a pass sees: all ``total``, or up to ``suffix_window`` columns past
    the block's end column ``block_end`` (``SamplingParams.suffix_window``; 0 = all)."""
    return total if not suffix_window else min(total, block_end + suffix_window)


def cache_window(
    mode: str, blocks: list[tuple[int, int]], block_idx: int, answer_start: int, total: int, step_in_block: int,
    refresh: int = 0,
) -> tuple[int, int] | None:
    """Canvas columns [w0, w1) a step recomputes; None means a full pass that (re)fills the cache.

    ``blocks`` is the answer's block plan (``block_plan``: [start, end) offsets in the
    answer), ``block_idx`` the block being denoised, ``answer_start`` the answer's first
    canvas column and ``total`` the end of what the passes see (the canvas length, or
    ``visible_end`` under a ``suffix_window``); the block is ``span`` below.

    ``none``: always all. ``prefix`` / ``dual`` (Fast-dLLM): a full pass at each
    block's first step, then block..end (prefix) or the block (dual).
    ``delayed``: one full pass (prefill) at the very first step, and again at the
    first step of every ``refresh``-th block when ``refresh`` > 0, else only the
    block; at another block's first step the caller adds the columns committed at
    the previous block's last step (``delayed_columns``). ``refresh`` 1 is the dual cache.
    ``dual_delayed``: as ``delayed``, except that another block's first step recomputes
    from the previous block's first column to the end: the previous block with its
    final tokens and the whole masked suffix; the prompt and older blocks keep the
    keys/values they were last computed with.
    """
    span = slice(answer_start + blocks[block_idx][0], answer_start + blocks[block_idx][1])
    if mode in ("delayed", "dual_delayed"):
        full = step_in_block == 0 and (block_idx == 0 or (refresh > 0 and block_idx % refresh == 0))
        if full:
            return None
        if mode == "dual_delayed" and step_in_block == 0:
            return (answer_start + blocks[block_idx - 1][0], total)
        return (span.start, span.stop)
    if mode == "none" or step_in_block == 0:
        return None
    return (span.start, total) if mode == "prefix" else (span.start, span.stop)


def delayed_columns(
    stale: list[list[int]], span: slice, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row window of a ``delayed`` cache at a block's first step: each row's stale columns
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
        on_step: called after every step with the (B, max_new_tokens) answer canvas.
        grammar_tokenizer: llguidance's tokenizer (``celeris.structured.grammar_tokenizer``), needed when a
            row has a ``grammar``: such a row commits, left to right, the longest run of its step's committed
            proposals from the block's leftmost open position that the grammar accepts, at least that position's
            grammar-masked token (``celeris.structured.grammar.constrain_commits``), and, once its grammar is
            complete, only the end-of-text token.

    Raises:
        ValueError: empty prompt, mismatched structural settings, or settings the model cannot
            do (``check_model_support``: e.g. blocks longer than 1 on a causal model).
        NoProgressError: a step committed nothing for a row (non-finite scores).
    """
    from celeris.sampling.block import block_mode, generate_block

    first = params[0] if isinstance(params, list) and params else params
    if isinstance(first, SamplingParams) and block_mode(model, first) is not None:  # block diffusion's reference
        if suffix_ids and any(suffix_ids):
            raise ValueError("suffix (infilling) needs a full-attention model: a block model never sees what follows")
        step_hook = (lambda _row, answer: on_step(answer[None])) if on_step is not None else None  # (1, N) per row
        return generate_block(model, prompt_ids, params, on_step=step_hook)
    start = time.perf_counter()
    rows = params if isinstance(params, list) else [params] * len(prompt_ids)
    if len(rows) != len(prompt_ids) or not prompt_ids:
        raise ValueError("need one SamplingParams per prompt and at least one prompt")
    if any(not p for p in prompt_ids):
        raise ValueError("prompt must not be empty")
    if len({r.structure_key() for r in rows}) > 1:
        raise ValueError("rows of one batch must share max_new_tokens, steps, block_length, remasking, decoding "
                         "and cache settings")
    sp = rows[0]
    cfg = model.config
    device = next(model.parameters()).device
    mask_id, eos_id = cfg.mask_token_id, cfg.eos_token_id
    canvas, attn, is_prompt, lp = build_canvas(
        prompt_ids, sp.max_new_tokens, mask_id, cfg.pad_token_id, suffix_ids, device
    )
    b = canvas.shape[0]
    settings = RowSettings.from_params(rows, device)
    use_cfg = bool((settings.cfg_scale > 0).any())
    generators = [make_generator(r.seed) for r in rows]
    banned = banned_token_ids(cfg)
    check_model_support(model, sp, any(suffix_ids or []))
    constraints = row_constraints(rows, grammar_tokenizer)
    blocks, steps_per_block = block_plan(sp.max_new_tokens, sp.block_length, sp.steps)
    caches = (KVCache(), KVCache()) if sp.cache != "none" else (None, None)
    nfe = steps = 0
    first_token_s: list[float | None] = [None] * b
    last_commit: list[list[int]] = [[] for _ in range(b)]  # per row: columns its latest committing step filled
    for block_idx, (s, e) in enumerate(blocks):
        span = slice(lp + s, lp + e)
        block_steps = min(steps_per_block, e - s)
        schedule = num_transfer_tokens((canvas[:, span] == mask_id).sum(-1), block_steps)  # (B, S)
        step_in_block = 0
        while bool((canvas[:, span] == mask_id).any()):
            visible = visible_end(canvas.shape[1], lp + e, sp.suffix_window)
            step_attn = attn  # (B, T) bool: the columns this step's passes attend to
            if visible < canvas.shape[1]:
                step_attn = attn & (torch.arange(canvas.shape[1], device=device) < visible)
            window = cache_window(sp.cache, blocks, block_idx, lp, visible, step_in_block, sp.cache_refresh)
            where = {"logits_slice": span}
            if sp.cache == "delayed" and step_in_block == 0 and window is not None:
                window, index = delayed_columns(last_commit, span, device)
                where = {"logits_index": index}
            logits = model(canvas, step_attn, **where, **cache_args(caches[0], window))  # (B, L, V)
            nfe += 1
            if use_cfg:  # unconditional pass: prompt (and suffix) replaced by the mask token
                uncond = model(canvas.masked_fill(is_prompt, mask_id), step_attn, **where,
                               **cache_args(caches[1], window))
                nfe += 1
                logits = guided(logits, uncond, settings.cfg_scale)
            k = schedule[:, min(step_in_block, block_steps - 1)]  # (B,)
            seen = None
            if any(r.repetition_penalty != 1 for r in rows):  # padding is not context
                seen = context_tokens(list(torch.where(attn, canvas, mask_id)), logits.shape[-1], mask_id, device)
            was_masked = (canvas[:, span] == mask_id).any(-1)  # (B,)
            old = canvas[:, span].clone()
            grammar = grammar_step(constraints, old, mask_id, [sp.max_new_tokens - s] * b, logits.shape[-1], device)
            new, committed = denoise_step(logits, old, mask_id, banned, k, settings, generators, seen,
                                          confidence_from=confidence_rule(model), allowed=grammar.allowed,
                                          force=grammar.force)
            canvas[:, span], committed = constrain_commits(constraints, grammar, old, new, committed, mask_id, eos_id)
            if bool((was_masked & ~committed.any(-1)).any()):
                raise NoProgressError(f"denoising step {steps + 1} committed no token (the model's scores are not "
                                      f"finite numbers)")
            for i in committed.any(-1).nonzero().flatten().tolist():
                last_commit[i] = (span.start + committed[i].nonzero().flatten()).tolist()
            steps += 1
            step_in_block += 1
            answer = canvas[:, lp : lp + sp.max_new_tokens]
            now = time.perf_counter() - start
            for i in (answer[:, 0] != mask_id).nonzero().flatten().tolist():
                if first_token_s[i] is None:
                    first_token_s[i] = now
            if on_step is not None:
                on_step(answer)
        if sp.early_exit and bool(answer_done(canvas[:, lp : lp + e], eos_id, mask_id).all()):
            break
    answer = canvas[:, lp : lp + sp.max_new_tokens]
    return GenerationOutput(
        answer_ids=answer.cpu(),
        token_ids=cut_at_eos(answer.cpu(), eos_id, mask_id),
        nfe=nfe,
        steps=steps,
        first_token_s=first_token_s,
        seconds=time.perf_counter() - start,
    )
