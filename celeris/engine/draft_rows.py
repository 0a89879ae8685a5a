"""Verified decoding's per-row state and one pass's layout: ``DraftRow`` (one sequence's tokens, drafts and the
columns its next pass computes: the engine's ``request.state`` under verified decoding), ``VerifiedOutput``
(``generate_verified``'s result), the pass's attention mask (``pass_mask``), its model call (``forward``) and the
log-probability entries of a row's new tokens (``row_logprobs``). ``celeris.engine.verified`` runs them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from celeris.models.layers import KVCache
from celeris.sampling.drafter import DraftState
from celeris.sampling.dry import DrySettings
from celeris.sampling.logprobs import TokenLogprob, entries
from celeris.sampling.params import SamplingParams
from celeris.sampling.select import top_p_filter
from celeris.sampling.step import History, RowSettings
from celeris.structured.grammar import Constraint


@dataclass(slots=True)
class VerifiedOutput:
    """Result of one batched ``generate_verified`` call.

    Attributes:
        token_ids: per row, the answer cut before the first end-of-text token.
        nfe: forward passes (a pass counts once for the whole batch; a step that prefills new rows while
            others decode runs two).
        row_passes: per row, the passes it took part in until it finished (its own NFE).
        drafted: per draft position j = 1..k, how many drafts were checked there (all rows).
        accepted: per draft position, how many of them were accepted.
        ttft_s: per row, seconds from the call's start until its first answer token.
        seconds: wall time of the call.
    """

    token_ids: list[list[int]]
    nfe: int
    row_passes: list[int]
    drafted: list[int]
    accepted: list[int]
    ttft_s: list[float | None] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Answer tokens per pass a row took part in (prefill included), over the whole batch."""
        return sum(len(t) for t in self.token_ids) / max(1, sum(self.row_passes))

    @property
    def acceptance(self) -> list[float]:
        """Per draft position, the share of checked drafts that were accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted, strict=True)]


def pass_mask(columns: torch.Tensor, slot_start: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
    """Attention mask of one pass: (B, 1, Lw, length) bool, True where a query column may see a key column.

    ``columns`` (B, Lw) are the computed columns; columns >= ``slot_start`` (B,) are the row's ``slots`` (B,)
    mask slots, which see every key before ``slot_start`` and the whole slot block; the other columns are causal.
    """
    keys = torch.arange(length, device=columns.device)[None, None, :]  # (1, 1, T)
    q = columns[:, :, None]  # (B, Lw, 1)
    s = slot_start[:, None, None]
    return torch.where(q >= s, keys < s + slots[:, None, None], keys <= q)[:, None]


def forward(model: object, ids: torch.Tensor, cache: KVCache, columns: torch.Tensor,
             mask: torch.Tensor, first: list[int] | None = None,
             capture: dict[int, torch.Tensor | None] | None = None, last: list[int] | None = None) -> torch.Tensor:
    """Logits (B, Lw, V) float32 of token ``ids`` (B, Lw) at ``columns`` (B, Lw, also their RoPE positions),
    reading and writing ``cache`` (per layer (B, H_kv, T, D)) at those columns. ``first``: per row, the first of
    its (left-aligned) columns whose logits are wanted; the earlier ones are left unset (any values). ``last``: per
    row, its last real column (the rest repeat it, as ``_run`` pads rows; default: ``Lw - 1``): the head then runs
    on columns ``first .. last`` of each row only, and a padded column gets its row's ``last`` logits (a repeated
    column has the same token, position and mask row, so the same logits). ``capture``: layer outputs to keep
    (``layout_hidden_states``), for a DFlash drafter."""
    hidden = model.layout_hidden_states(ids, columns, mask, cache, columns, capture=capture)  # (B, Lw, d)
    if first is None:
        return model.logits(hidden)
    b, width, d = hidden.shape
    start = torch.tensor(first, device=hidden.device)  # (B,)
    end = torch.tensor([width - 1] * b if last is None else last, device=hidden.device)  # (B,)
    span = int((end - start).max()) + 1  # a prefill of ragged prompts: 1 + slots, not the longest prompt
    index = torch.minimum(start[:, None] + torch.arange(span, device=hidden.device)[None], end[:, None])  # (B, span)
    part = model.logits(hidden.gather(1, index[..., None].expand(b, span, d)))  # (B, span, V)
    at = torch.arange(width, device=hidden.device)[None]  # (1, Lw): column p of a row reads part[p - first]
    pick = (torch.minimum(at, end[:, None]) - start[:, None]).clamp(min=0)  # (B, Lw)
    return part.gather(1, pick[..., None].expand(b, width, part.shape[-1]))


@dataclass(eq=False)
class DraftRow:
    """One sequence under verified decoding: its tokens, drafts and the columns its next pass computes.

    Columns are the row's own positions (0 = its first prompt token; rows are never padded).
    """

    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    k: int
    end_ids: frozenset[int] = frozenset()  # ids that end the answer (with ``early_exit``)
    constraint: Constraint | None = None  # the grammar state (``celeris.structured``), advanced by committed tokens
    draft_state: DraftState | None = None  # its DFlash drafter's cache and queued features (with a drafter)
    history: History | None = None  # with a penalty: its tokens so far ((1, V) each; ``penalize_along``), else None
    penalty_settings: RowSettings | None = None  # with a penalty: its settings as one row's tensors
    dry: DrySettings | None = None  # its DRY settings (``celeris.sampling.dry``), None: no DRY
    counting: bool = True  # its history still counts committed tokens (False once an end id came: ``History.add``)
    acceptance_lengths: list[int] = field(default_factory=list)  # drafts accepted, per pass that checked drafts
    answer: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    draft_probs: list = field(default_factory=list)
    pending: int = -1  # column whose next-token logits give the first token of the next pass
    slot_start: int = 0  # first mask-slot column of the next pass
    num_slots: int = 0  # mask slots in the next pass (k, or 0 when its drafts came from prompt lookup)
    num_cached: int = 0  # prompt tokens whose keys/values are in its row (prefix cache, chunks): the prefill starts there
    prefilling: bool = False  # its prompt is prefilled ahead of its first pass, in chunks (chunked prefill)
    chunk: int = 0  # while prefilling: prompt columns its next pass computes (0: paused, it redoes one it holds)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # with params.logprobs: the last pass's tokens'
    passes: int = 0
    finished: bool = False
    hit_eos: bool = False
    owner: object | None = None  # the engine's Request this row decodes (``VerifiedPath``), None outside the engine

    def plan_chunk(self, target: int, chunk: int) -> None:
        """Set whether its prompt is still prefilled in chunks, up to column ``target`` (0: not chunked), and if so
        the ``chunk`` more columns its next pass computes (fewer at the end; 0: it pauses, redoing one it holds)."""
        self.prefilling = self.num_cached < target
        self.chunk = max(0, min(chunk, target - self.num_cached)) if self.prefilling else 0

    @property
    def columns(self) -> list[int]:
        """Columns of the next pass: a chunk of the prompt past its cached prefix (chunked prefill), the prompt past
        its cached prefix and k slots (prefill), else pending, drafts, slots."""
        if self.prefilling:
            first = self.num_cached if self.chunk else max(self.num_cached - 1, 0)
            return list(range(first, self.num_cached + self.chunk)) or [first]
        first = self.num_cached if self.pending < len(self.prompt_ids) - 1 else self.pending
        return list(range(first, self.slot_start + self.num_slots))


def row_logprobs(row: DraftRow, logits: torch.Tensor, c0: int, new: list[int], mode: str) -> list[TokenLogprob]:
    """The entries of ``new`` (``celeris.sampling.logprobs``), token j chosen from ``logits`` (Lw, V) at column
    c0 + j: raw, or under ``mode`` ``processed_logprobs`` the head after top-p and temperature (the distribution
    verification samples from)."""
    scores, p = logits[c0 : c0 + len(new)], row.params
    if mode == "processed_logprobs":
        if p.top_p < 1:
            scores = top_p_filter(scores[None], torch.tensor([p.top_p], device=scores.device))[0]
        if p.temperature > 0:
            scores = scores / p.temperature
    return entries(scores, torch.tensor(new, dtype=torch.long), p.logprobs)
