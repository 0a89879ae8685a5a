"""What a decoding mode's engine path is given and what the engine asks of it.

A decoding mode (``celeris.sampling.modes.DecodingMode``) names its path: a factory ``path(context) -> ModePath``.
The engine calls it once, at the mode's first request, with the parts every path shares (``PathContext``: the
model, the one ``ModelRunner`` that calls it, compiled or not, the engine's settings); the path then owns its
requests' cursors (``Request.state``) and, each step, lays out its pass(es), runs them through the runner,
commits the chosen tokens into each ``Request.canvas`` and counts the step (``Request.record_step``), advancing or
finishing each request. The built-in paths are ``celeris.engine.masked.MaskedPath``,
``celeris.engine.blocks.BlockDecoder`` and ``celeris.engine.verified_path.VerifiedPath``; a plug-in's is its own class
(``tests/engine/test_toy_mode.py`` holds one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from celeris.config import EngineConfig
from celeris.engine.request import Request
from celeris.engine.runner import ModelRunner


@dataclass(frozen=True, slots=True)
class PathContext:
    """The engine's shared parts, handed to each mode's path factory.

    Attributes:
        model: the loaded model (its ``config``: ``mask_token_id``, ``eos_token_id``, ``pad_token_id``, ...).
        runner: the engine's one model runner: call the model through it (``runner.model`` is the full forward,
            compiled when ``config.enforce_eager`` is False; ``hidden_states``, ``layout_hidden_states`` and
            ``logits`` likewise), on ``runner.device``; take KV rows from its one store (``runner.kv``, a
            ``celeris.engine.kv.KVStore``: ``kv.segment()``, then ``grow``/``shrink``).
        config: the engine's settings (``max_num_seqs``, ``logprobs_mode``, ``enable_prefix_caching``, ...).
        max_model_len: the most tokens one request may hold (None: no limit known).
        eos_id: the model's end-of-text id (a request's own end ids: ``Request.ends``).
    """

    model: torch.nn.Module
    runner: ModelRunner
    config: EngineConfig
    max_model_len: int | None
    eos_id: int


class ModePath(Protocol):
    """What the engine asks of a decoding mode's path (``Engine.paths``)."""

    def step(self, requests: list[Request]) -> list[Request]:
        """One step (its passes) for the running requests of this mode, in place: each request's canvas holds the
        committed tokens, its step is counted (``Request.record_step``) and it is advanced or finished. Returns
        the requests to emit (usually ``requests``)."""

    def token_cost(self, requests: list[Request]) -> int:
        """Columns the next step over ``requests`` (all of this mode) computes: the scheduler's token budget."""

    def kv_rows(self, request: Request) -> int:
        """Rows of the engine's KV store (``runner.kv``) ``request`` takes while it runs (0: it holds no
        keys/values): the scheduler admits requests while the store has rows for them."""

    def release(self) -> None:
        """Free the memory (KV rows, cursors) of finished or aborted requests."""


# Optional: ``prefill_columns(request) -> int``, the prompt columns whose keys/values the path can compute ahead of
# the request's first step, in chunks (chunked prefill; ``celeris.engine.scheduler``). While ``request.is_prefilling``
# its step computes ``request.prefill_chunk`` of them (adding them to ``request.num_computed``), commits nothing and
# does not return it; ``token_cost`` counts the chunk. A path without it prefills every prompt whole.

PathFactory = Callable[[PathContext], ModePath]


PAD_WASTE = 0.125  # a group's padded columns stay within 1 + this of what its rows compute alone (``pad_groups``)


def pad_groups(widths: dict[int, int], waste: float = PAD_WASTE) -> list[list[int]]:
    """The rows of ``widths`` (row -> the columns its prefill computes alone) split into groups of passes that each
    pad little, each group's rows in ascending order: a pass pads every row to its widest, so 8 new prompts of 52 to
    87 tokens in one pass computed 8 x 87 columns for 523 real ones. Rows sorted by width join a group while its
    padded columns stay within ``1 + waste`` of its rows' own. For the CPU, where a row's numbers on the fast pass do
    not depend on the rows beside it (the block kernel and the C attention compute each row alone), so grouping
    changes time, not tokens; an accelerator computes a padded batch in parallel and keeps one pass."""
    groups: list[list[int]] = []
    for i in sorted(widths, key=widths.__getitem__):
        if groups and (len(groups[-1]) + 1) * widths[i] <= (1 + waste) * sum(widths[j] for j in (*groups[-1], i)):
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(g) for g in groups]
