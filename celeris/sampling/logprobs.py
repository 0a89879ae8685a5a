"""Log-probabilities of committed tokens and of prompts (``SamplingParams.logprobs`` / ``prompt_logprobs``).

What a value means depends on the decoding mode, and on the engine's ``logprobs_mode``
(``EngineConfig.logprobs_mode``, vLLM's ``--logprobs-mode``):

- ``raw_logprobs`` (the default, as vLLM v1): ``log_softmax`` of the model's logits over its whole vocabulary
  (after classifier-free guidance, before the repetition penalty, the banned ids, a grammar, temperature, top-p,
  top-k and min-p). The top alternatives may then name an id no decoding produces (a diffusion model's mask
  token).
- ``processed_logprobs``: the distribution the token was drawn from: the logits after the penalty, the banned
  ids, the grammar and the filters (``celeris.sampling.step.prepare_logits``), divided by the temperature when it
  is above 0. Under verified decoding: the next-token head after top-p and temperature (a grammar's mask is not
  applied there).

Next-token and verified decoding: the next-token head's log-probability of each returned token, and the top
alternatives, at that token's position. Diffusion and block decoding have no left-to-right likelihood: each
token's value is taken from the distribution it was committed from, at the denoising step that committed it
(its position's logits in that step's pass, the other positions partly masked).

A prompt (``prompt_logprobs``, causal models only) is scored by one full causal pass: token i from the logits
at i - 1; the first token has no value (None), as in vLLM and OpenAI's ``echo``.

Asking for nothing costs nothing: every function here runs only for the rows that asked, and only at their
committed positions. Values are finite: -inf (a token a filter removed) is reported as ``FLOOR``, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from celeris.config import LOGPROBS_MODES as LOGPROBS_MODES
from celeris.sampling.step import History, RowSettings, prepare_logits

MAX_LOGPROBS = 20  # most alternatives one position may ask for (vLLM's max_logprobs, OpenAI's top_logprobs)
FLOOR = -9999.0  # what -inf is reported as (vLLM's value)
PROMPT_CHUNK = 512  # prompt positions whose logits ``prompt_entries`` holds at once


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability (natural log, <= 0) and the ``top`` most likely tokens at its position
    ((token id, log-probability) pairs, most likely first; as many as the request asked, fewer when a filter left
    fewer)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def entries(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[TokenLogprob]:
    """The log-probability of ``tokens`` under ``log_softmax(logits)`` with the ``k`` most likely alternatives.

    Args:
        logits: (N, V) float logits (-inf allowed).
        tokens: (N,) int64 token ids.
        k: alternatives per position, 0..``MAX_LOGPROBS``.

    Returns:
        N entries; -inf values reported as ``FLOOR`` and alternatives at -inf left out.
    """
    if logits.shape[0] == 0:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    chosen = logp.gather(-1, tokens.to(logp.device)[:, None])[:, 0].clamp(min=FLOOR).tolist()
    if k:
        values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)  # (N, k)
        values, ids = values.tolist(), ids.tolist()
    else:
        values, ids = [[] for _ in chosen], [[] for _ in chosen]
    return [TokenLogprob(int(t), lp, tuple((i, v) for i, v in zip(row_ids, row_values, strict=True) if v > FLOOR))
            for t, lp, row_ids, row_values in zip(tokens.tolist(), chosen, ids, values, strict=True)]


def tempered(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """(N, V) processed logits divided by each row's temperature (N,) where it is above 0 (greedy rows as they
    are): the distribution ``processed_logprobs`` reports."""
    t = temperature.to(logits.device).float()
    return torch.where(t[:, None] > 0, logits / t.clamp(min=1e-6)[:, None], logits)


def step_entries(logits: torch.Tensor, new: torch.Tensor, committed: torch.Tensor, ks: list[int | None],
                 processed: torch.Tensor | None = None,
                 temperature: torch.Tensor | None = None) -> list[dict[int, TokenLogprob]]:
    """Per row, {block column: entry} for the columns one denoising step committed, for the rows that asked.

    Args:
        logits: (B, L, V) the step's logits (raw).
        new / committed: (B, L) the step's new block and committed positions.
        ks: per row, ``SamplingParams.logprobs`` (None: the row asked for nothing).
        processed: (B, L, V) the step's processed logits (``prepare_logits``), or None for raw values;
            with ``temperature`` (B,).

    Returns:
        B dicts ({} for a row that asked for nothing).
    """
    out: list[dict[int, TokenLogprob]] = [{} for _ in ks]
    asked = [b for b, k in enumerate(ks) if k is not None]
    if not asked:
        return out
    rows = torch.tensor(asked, device=committed.device)
    mask = committed[rows]  # (A, L)
    a_idx, cols = mask.nonzero(as_tuple=True)
    if a_idx.numel() == 0:
        return out
    b_idx = rows[a_idx]
    source = logits if processed is None else processed
    picked = source[b_idx, cols]  # (N, V)
    if processed is not None and temperature is not None:
        picked = tempered(picked, temperature.to(picked.device)[b_idx])
    k = max(ks[b] for b in asked)
    for b, c, e in zip(b_idx.tolist(), cols.tolist(), entries(picked, new[b_idx, cols], k), strict=True):
        kb = ks[b]
        out[b][c] = e if kb == k else TokenLogprob(e.token_id, e.logprob, e.top[:kb])
    return out


@torch.no_grad()
def committed_entries(logits: torch.Tensor, new: torch.Tensor, committed: torch.Tensor, ks: list[int | None],
                      settings: RowSettings, banned_ids: list[int], history: History | None,
                      allowed: torch.Tensor | None, mode: str) -> list[dict[int, TokenLogprob]]:
    """``step_entries`` of one denoising step, raw or (``mode`` "processed_logprobs") from the logits the step
    sampled from (``prepare_logits`` with the step's settings, banned ids, penalties' history and grammar mask).

    Shapes as ``step_entries``: logits (B, L, V), new / committed (B, L); returns B {block column: entry} dicts.
    """
    processed = None
    if mode == "processed_logprobs":
        processed, _ = prepare_logits(logits, settings, banned_ids, history, allowed)
    return step_entries(logits, new, committed, ks, processed, settings.temperature)


def prompt_entries(model: torch.nn.Module, prompt_ids: list[int], k: int) -> list[TokenLogprob | None]:
    """Score a prompt with one full causal pass of ``model``: entry i from the logits at i - 1, None for the first
    token. Raw values. A ``TransformerLM`` (``hidden_states`` / ``logits``, ``logits_shift`` 1) runs the head on
    ``PROMPT_CHUNK`` positions at a time; another model's ``forward(ids, mask, logits_slice)`` (row i predicts token
    i) scores the whole prompt at once.

    Raises:
        ValueError: the model is not causal (a diffusion model has no left-to-right likelihood).
    """
    if not getattr(model.config, "is_causal", False):
        raise ValueError("prompt_logprobs needs a causal (autoregressive or hybrid) model; a diffusion model has no "
                         "left-to-right likelihood of its prompt")
    if len(prompt_ids) < 2:
        return [None] * len(prompt_ids)
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    if not (hasattr(model, "hidden_states") and getattr(model, "logits_shift", 0) == 1):
        logits = model(ids, None, logits_slice=slice(1, len(prompt_ids)))[0]  # (P - 1, V): row i scores token i + 1
        return [None, *entries(logits, ids[0, 1:], k)]
    hidden = model.hidden_states(ids)[0, :-1]  # (P - 1, d): row i scores token i + 1
    out: list[TokenLogprob | None] = [None]
    for a in range(0, hidden.shape[0], PROMPT_CHUNK):  # a long prompt's (P, V) logits never exist at once
        out += entries(model.logits(hidden[a : a + PROMPT_CHUNK]), ids[0, 1 + a : 1 + a + PROMPT_CHUNK], k)
    return out
