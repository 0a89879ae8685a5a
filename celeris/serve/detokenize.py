"""The HTTP side of an answer's text: the ``celeris`` extension object of a choice (``decoding_details``), its
canvas view for ``stream_mode: "denoise"`` (``denoise_details``), and ``Update``: what the serving layer tells a
client about one choice after an engine event, which ``serve/chat.py`` turns into chat chunks.

Stop strings, ``IncrementalText`` and ``render_canvas`` live in ``celeris.text`` (below the engine, so the offline
facade needs nothing from ``serve/``); they are re-exported here for one release.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from celeris.serve.protocol import DecodingDetails, DenoiseDetails
from celeris.text import (  # noqa: F401 (re-exported for one release: celeris.text is the home)
    MASK_PLACEHOLDER,
    REPLACEMENT_CHAR,
    IncrementalText,
    cut_at_stop,
    find_stop,
    partial_stop_len,
    render_canvas,
    tokens_within,
)

if TYPE_CHECKING:
    from celeris.sampling.logprobs import TokenLogprob
    from celeris.sampling.params import SamplingParams
    from celeris.serve.async_engine import StepEvent


def denoise_details(details: DecodingDetails, steps: list[int | None], event: StepEvent, mask_id: int,
                    piece: Callable[[int], str]) -> DenoiseDetails:
    """``details`` plus the canvas after ``event`` (``DenoiseDetails``): each committed position's text piece and
    the step that committed it (``steps``, one per canvas position, updated here: positions newly unmasked since
    the previous event get ``event.steps``), and under verified decoding the pending drafts. ``piece`` decodes
    one token id alone."""
    ids = event.canvas_ids or []
    for i, tid in enumerate(ids):
        if tid != mask_id and steps[i] is None:
            steps[i] = event.steps
    tokens = [None if tid == mask_id else piece(tid) for tid in ids]
    return DenoiseDetails(**details.model_dump(), tokens=tokens, token_steps=list(steps),
                          drafts=[piece(t) for t in event.draft_ids or []])


def decoding_details(params: SamplingParams, event: StepEvent) -> DecodingDetails:
    """The ``celeris`` extension object of a choice after ``event``."""
    return DecodingDetails(
        nfe=event.nfe, drafter_passes=event.drafter_passes, steps=event.steps,
        tokens_per_forward=round(event.num_committed / event.nfe, 4) if event.nfe else 0.0,
        block_length=min(params.block_length, params.max_tokens), cache=params.cache, decoding=params.decoding,
        remasking=params.remasking,
    )


@dataclass(slots=True)
class Update:
    """What the client should learn about one choice after an engine event."""

    index: int
    delta: str
    finish_reason: str | None
    canvas: str | None = None
    step: int | None = None
    details: DecodingDetails | None = None
    logprobs: list[TokenLogprob | None] | None = None  # streamed: the entries of the tokens this update released
