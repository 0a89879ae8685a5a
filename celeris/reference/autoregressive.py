"""Autoregressive decoding with a KV cache, for the causal twin (``is_causal`` config).

The baseline the diffusion samplers are compared with: same architecture, same
data, one token per forward pass. The prompt is prefilled in one pass that
fills the cache; each later step runs only the newest token (a window of one
position) against the cached keys and values.
"""

from __future__ import annotations

import time

import torch

from celeris.models.layers import KVCache
from celeris.sampling.block import answer_ends
from celeris.sampling.dry import DrySettings
from celeris.sampling.output import GenerationOutput, build_canvas, cut_at_eos
from celeris.sampling.params import SamplingParams
from celeris.sampling.select import sample_tokens
from celeris.sampling.step import (
    History,
    RowSettings,
    banned_token_ids,
    check_prompts,
    make_generator,
    prepare_logits,
)


@torch.no_grad()
def generate_autoregressive(
    model: torch.nn.Module,
    prompt_ids: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    use_cache: bool = True,
) -> GenerationOutput:
    """Next-token decoding of ``max_tokens`` tokens per prompt (greedy at temperature 0; top-p and the
    repetition penalty over prompt and answer so far as in the engine).

    Args:
        model: a causal model (``config.is_causal``) with the KVCache/window interface.
        prompt_ids: B non-empty prompts (left-padded together).
        use_cache: False recomputes the whole sequence every step (the slow,
            obviously-correct reference the cached path is tested against).

    Returns:
        GenerationOutput; ``nfe`` = forward passes (prefill counts as one),
        ``ttft_s`` = prefill latency per row. Stops early once every row
        has produced an end-of-text token.

    Raises:
        ValueError: the model is not causal, or a prompt is empty.
    """
    start = time.perf_counter()
    config = model.config
    if not getattr(config, "is_causal", False):
        raise ValueError("autoregressive decoding needs a causal model (config is_causal=true)")
    rows = params if isinstance(params, list) else [params] * len(prompt_ids)
    check_prompts(prompt_ids)
    n = rows[0].max_tokens
    device = next(model.parameters()).device
    canvas, attn, _, answer_start = build_canvas(prompt_ids, n, config.pad_token_id, config.pad_token_id, None, device)
    attn[:, answer_start:] = True  # answer positions become real tokens as they are written
    settings = RowSettings.from_params(rows, device)
    dry = [DrySettings.of(r, model) for r in rows]  # DRY after each row's prompt and answer so far
    generators = [make_generator(r.seed) for r in rows]
    cache = KVCache() if use_cache else None
    banned = banned_token_ids(config)
    ttft_s: list[float | None] = [None] * len(prompt_ids)
    nfe = 0
    for t in range(answer_start, answer_start + n):
        window = (t - 1, t) if cache is not None and t > answer_start else None  # the newest token only
        hidden = model.hidden_states(canvas, attn, cache, window)  # (B, T, d), or (B, 1, d) for the window
        logits = model.logits(hidden[:, t - 1 : t] if window is None else hidden)  # (B, 1, V): token t from h[t-1]
        nfe += 1
        # the context so far (prompt and answer, not padding) and the answer so far
        history = History.of(settings, [row[:t][a[:t]] for row, a in zip(canvas, attn, strict=True)],
                             list(canvas[:, answer_start:t]), logits.shape[-1], config.mask_token_id, device,
                             [answer_ends(r, [config.eos_token_id]) for r in rows], dry)
        logits, _ = prepare_logits(logits, settings, banned, history)
        canvas[:, t] = sample_tokens(logits, settings.temperature, generators)[:, 0]
        if t == answer_start:
            ttft_s = [time.perf_counter() - start] * len(prompt_ids)
        if rows[0].early_exit and bool((canvas[:, answer_start : t + 1] == config.eos_token_id).any(-1).all()):
            canvas[:, t + 1 :] = config.eos_token_id  # never decoded: every row already ended
            break
    answer = canvas[:, answer_start : answer_start + n].cpu()
    return GenerationOutput(answer_ids=answer, token_ids=cut_at_eos(answer, config.eos_token_id, config.mask_token_id),
                            nfe=nfe, steps=nfe, ttft_s=ttft_s, seconds=time.perf_counter() - start)
