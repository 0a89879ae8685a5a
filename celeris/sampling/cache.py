"""KV-cache policies as registered objects: which canvas columns a denoising step recomputes.

| mode | full pass (refills the cache) | other steps recompute | a causal model |
|---|---|---|---|
| ``none`` | every step | (no cache) | yes |
| ``prefix`` (Fast-dLLM arXiv:2505.22618) | each block's first step | the block to the end | no |
| ``dual`` (Fast-dLLM) | each block's first step | the block | no |
| ``delayed`` (dKV-Cache arXiv:2505.15781) | the first, every ``cache_refresh``-th block's | the block (+ stale) | yes |
| ``dual_delayed`` | as ``delayed`` | the block; a block's first step: the previous block to the end | no |

``prefix``, ``dual`` and the delayed modes are approximations for a bidirectional model (what is not
recomputed keeps keys/values computed with older tokens). For a causal model ``delayed`` is exact (each token's
keys/values are written once, a step after it is committed) and ``prefix``/``dual``/``dual_delayed`` would re-run
a full pass (or one to the end of the canvas) for every token, so a causal model accepts only the modes marked
``exact_for_causal``. "+ stale": a block's first step also rewrites the columns committed at the
previous block's last step (``rewrites_stale``).

The reference sampler (``celeris.reference.masked``) and the engine (``celeris.engine.request``) both ask
``CACHE_MODES`` for each step's columns. A new mode is one window function and one ``CachePolicy`` entry;
``SamplingParams`` takes its ``cache`` choices from ``CACHE_MODES`` at call time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# window(blocks, block_idx, answer_start, total, step_in_block, refresh) -> [w0, w1) or None (a full pass)
Window = Callable[[list[tuple[int, int]], int, int, int, int, int], "tuple[int, int] | None"]


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """One ``cache`` choice.

    Attributes:
        window: the canvas columns [w0, w1) a step recomputes, None for a full pass (``cache_window``).
        help: one line for ``--help`` and the docs, with the source.
        exact_for_causal: a causal (autoregressive) model may use it: exact at one pass per token.
        params: the ``SamplingParams`` fields it reads (``cache_refresh``).
        rewrites_stale: a block's first step also recomputes the columns committed at the previous block's last
            step (``delayed_columns``), whose cached keys/values were computed while they were still masked.
        recomputes_suffix: its passes recompute the masked suffix (a ``suffix_window`` can shorten them).
        uses_cache: False for ``none``: every step is a full pass without a cache.
    """

    window: Window
    help: str
    exact_for_causal: bool
    params: tuple[str, ...] = ()
    rewrites_stale: bool = False
    recomputes_suffix: bool = True
    uses_cache: bool = True

    @property
    def reads(self) -> tuple[str, ...]:
        """The ``SamplingParams`` fields a request with this mode reads beyond the common ones."""
        return self.params


def _span(blocks: list[tuple[int, int]], block_idx: int, answer_start: int) -> tuple[int, int]:
    return answer_start + blocks[block_idx][0], answer_start + blocks[block_idx][1]


def _no_cache(blocks: list[tuple[int, int]], block_idx: int, answer_start: int, total: int, step_in_block: int,
              refresh: int) -> None:
    return None


def _prefix(blocks: list[tuple[int, int]], block_idx: int, answer_start: int, total: int, step_in_block: int,
            refresh: int) -> tuple[int, int] | None:
    return None if step_in_block == 0 else (_span(blocks, block_idx, answer_start)[0], total)


def _dual(blocks: list[tuple[int, int]], block_idx: int, answer_start: int, total: int, step_in_block: int,
          refresh: int) -> tuple[int, int] | None:
    return None if step_in_block == 0 else _span(blocks, block_idx, answer_start)


def _refills(block_idx: int, step_in_block: int, refresh: int) -> bool:
    """The delayed modes' full pass: the prefill, and every ``refresh``-th block's first step when refresh > 0."""
    return step_in_block == 0 and (block_idx == 0 or (refresh > 0 and block_idx % refresh == 0))


def _delayed(blocks: list[tuple[int, int]], block_idx: int, answer_start: int, total: int, step_in_block: int,
             refresh: int) -> tuple[int, int] | None:
    return None if _refills(block_idx, step_in_block, refresh) else _span(blocks, block_idx, answer_start)


def _dual_delayed(blocks: list[tuple[int, int]], block_idx: int, answer_start: int, total: int,
                  step_in_block: int, refresh: int) -> tuple[int, int] | None:
    if _refills(block_idx, step_in_block, refresh):
        return None
    if step_in_block == 0:  # the previous block with its final tokens and the whole masked suffix
        return answer_start + blocks[block_idx - 1][0], total
    return _span(blocks, block_idx, answer_start)


CACHE_MODES: dict[str, CachePolicy] = {
    "none": CachePolicy(_no_cache, "no KV cache: every step a full pass", exact_for_causal=True, uses_cache=False),
    "prefix": CachePolicy(_prefix, "Fast-dLLM prefix cache: refreshed per block, then the block to the end",
                          exact_for_causal=False),
    "dual": CachePolicy(_dual, "Fast-dLLM dual cache: refreshed per block, then only the block",
                        exact_for_causal=False),
    "delayed": CachePolicy(_delayed, "dKV-Cache delayed caching: only the block, refreshed per --cache-refresh",
                           exact_for_causal=True, params=("cache_refresh",), rewrites_stale=True,
                           recomputes_suffix=False),
    "dual_delayed": CachePolicy(_dual_delayed, "the prompt and older blocks frozen, the rest refreshed per block",
                                exact_for_causal=False, params=("cache_refresh",)),
}


def visible_end(total: int, block_end: int, suffix_window: int) -> int:
    """Canvas columns [0, visible_end) a pass sees: all ``total``, or up to ``suffix_window`` columns past
    the block's end column ``block_end`` (``SamplingParams.suffix_window``; 0 = all)."""
    return total if not suffix_window else min(total, block_end + suffix_window)


def cache_window(
    mode: str, blocks: list[tuple[int, int]], block_idx: int, answer_start: int, total: int, step_in_block: int,
    refresh: int = 0,
) -> tuple[int, int] | None:
    """Canvas columns [w0, w1) a step recomputes under cache ``mode``; None means a full pass that (re)fills the
    cache (the table in the module docstring).

    ``blocks`` is the answer's block plan (``block_plan``: [start, end) offsets in the answer), ``block_idx`` the
    block being denoised, ``answer_start`` the answer's first canvas column and ``total`` the end of what the
    passes see (the canvas length, or ``visible_end`` under a ``suffix_window``). ``refresh`` is
    ``cache_refresh``. Under a mode with ``rewrites_stale`` the caller adds the stale columns at a block's first
    step (``celeris.reference.masked.delayed_columns``).
    """
    return CACHE_MODES[mode].window(blocks, block_idx, answer_start, total, step_in_block, refresh)
