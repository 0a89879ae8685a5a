"""The engine's block-diffusion path: one pass per step over every running request's current block, with an
exact KV cache of the committed history.

For a model with a block-causal or causal-history contract (``celeris.models.contract``) the history's
keys/values never change once its tokens are final, so they are written once into a ``KVPool`` row (of the
engine's one ``KVStore``) per request and read in place afterwards, as in autoregressive decoding (SGLang's and
LMDeploy's block diffusion on a paged cache, in its simplest form). Each step a row computes only the columns
``[cached_upto, block end)``:

- a new request's first pass is its prefill: the prompt's full blocks (history) and its first block, together;
- the other steps of a block compute just the block (its keys/values are rewritten each step, read only by
  the block itself);
- a finished block is not given a pass of its own to write its final keys/values (the published SDAR loop
  spends one): its columns are recomputed as history in the next block's first pass, which then also writes
  them into the pool (under ``commit_first``, that is the pass that commits the block's first token).
  ``nfe`` counts every pass, so a request's ``nfe`` equals its steps (plus its prefill chunks, below).

Chunked prefill (``celeris.engine.scheduler``): the prompt's history, the columns before its first attention block
(``prefill_columns``), can be computed ahead of the first step, a chunk per step, in the same pass as the running
rows (a prefilling row's window is its chunk; it scores and commits nothing; a paused one, given no chunk, sits the
pass out, its pool row left as it is). Each format's prompt attention decides
where a chunk may end, so that every cached key/value equals the whole prefill's: under ``causal_history`` (the
Celeris hybrids) a history column sees the columns up to itself, so any chunk is exact; under ``block_causal``
(SDAR, Fast-dLLM v2, LLaDA2.0) it sees its whole attention block, so chunks are whole blocks (the scheduler's
chunk is rounded up to a block end, which ``token_cost`` counts: the largest chunk within the budget is then a
whole number of blocks). A prompt under ``answer`` alignment with ``block_causal`` attention is one block of
history (bidirectional) and is prefilled whole. The first step then computes the first block (with the prompt's
last partial block) reading the history from the pool, as every later step does.

A shifted model (Fast-dLLM v2) scores the block's first column from the hidden state of the history's last
column, which is then recomputed too (its keys/values do not change). Under ``commit_first`` (Fast-dLLM v2, the
Celeris hybrids) a block's first token is committed alone before the block is denoised, as Fast-dLLM v2's
``generate`` does: that pass computes the finished history (writing it) and scores just that column. Requests
at different blocks, with different prompt lengths and settings, share each pass: per-row column windows
(``celeris.models.layers.Window``) and a per-row layout mask. The commit rules are
``celeris.sampling.step.denoise_step``'s, on the same sub-blocks and schedules as the reference sampler
(``celeris.reference.block.generate_block``), whose tokens the engine must reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from celeris.engine.kv import KVPool
from celeris.engine.path import PathContext
from celeris.engine.request import NO_PROGRESS, Request
from celeris.models.contract import layout_mask
from celeris.models.layers import KVCache, column_window, gather_positions
from celeris.sampling.block import (
    Unit,
    block_steps,
    block_units,
    contract_of,
    end_reached,
    first_token_pending,
    unit_schedule,
)
from celeris.sampling.logprobs import committed_entries
from celeris.sampling.step import (
    History,
    RowSettings,
    banned_token_ids,
    commit_step,
    confidence_rule,
)


@dataclass(eq=False)
class BlockRow:
    """A request's place in its answer: the sub-block being denoised and how much history the pool holds."""

    request: Request
    units: list[Unit]
    steps: int = 1  # denoising steps per sub-block (``celeris.sampling.block.block_steps``)
    unit_idx: int = 0
    step_in_unit: int = 0
    cached_upto: int = 0  # canvas columns [0, cached_upto) hold final keys/values in the pool
    schedule: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.long))
    block_steps: int = 1

    @property
    def unit(self) -> Unit:
        return self.units[self.unit_idx]

    def start_unit(self) -> None:
        """The linear schedule of the current sub-block (``celeris.sampling.block.unit_schedule``)."""
        self.schedule, self.block_steps = unit_schedule(self.steps, self.request.params.block_length)
        self.step_in_unit = 0


class BlockDecoder:
    """Runs the block-diffusion steps of the engine's requests (module docstring): the engine's path for mode
    "block". Each request's ``BlockRow`` is its ``request.state``; the requests it holds are its KV pool's owners.

    Args:
        context: the engine's shared parts (``celeris.engine.path.PathContext``): a model with a block-diffusion
            contract (``celeris.sampling.block.contract_of``), the runner whose entries the passes call, and
            ``EngineConfig.logprobs_mode``.

    Raises:
        ValueError: the model has no block-diffusion contract.
    """

    mode = "block"

    def __init__(self, context: PathContext) -> None:
        model = context.model
        contract = contract_of(model)
        if contract is None:
            raise ValueError(f"{type(model).__name__} has no block-diffusion contract: no block path for it")
        self.model, self.contract = model, contract
        self.entry = context.runner  # what the passes call (``hidden_states``, ``logits``): compiled or not
        cfg = model.config
        self.mask_id, self.eos_id, self.pad_id = cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id
        self.banned_ids = banned_token_ids(cfg)
        self.confidence_from = confidence_rule(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.pool = KVPool(context.runner.kv)  # its rows of the engine's one KV store
        self.num_passes = 0
        self.logprobs_mode = context.config.logprobs_mode

    def _add(self, request: Request) -> None:
        """Give a new request its units and a pool row (zeros; its first pass writes the prompt and block)."""
        p, n = request.answer_start, request.params.max_tokens
        context = getattr(self.model.config, "max_position_embeddings", None)
        row = BlockRow(request, block_units(p, n, self.contract, request.params.block_length, context),
                       block_steps(self.contract, request.params))
        pad = row.units[-1][1] - request.num_tokens  # the last block is denoised whole, as the published samplers do
        if pad > 0:
            request.canvas = torch.cat([request.canvas, request.canvas.new_full((pad,), self.mask_id)])
        row.start_unit()
        attn = self.model.layers[0].attn  # TransformerLM's grouped K/V heads, or CelerisModel's full heads
        heads = getattr(attn, "num_kv_heads", attn.num_heads)
        zeros = [torch.zeros(heads, request.num_tokens, attn.head_dim, dtype=self.dtype, device=self.device)
                 for _ in self.model.layers]
        self.pool.store(request, "cond", zeros, zeros)
        request.state = row

    def token_cost(self, requests: list[Request]) -> int:
        """Columns the next pass over ``requests`` computes (the scheduler's budget): rows x the widest row's
        columns, a new request's being its prefill (the prompt and its first block), a prefilling one's its chunk
        (``_chunk_columns``; a paused one takes no row), a running one's ``_columns``."""
        widths = []
        for r in requests:
            if self._paused(r):
                continue  # its row sits the pass out
            if r.is_prefilling:
                widths.append(len(self._chunk_columns(r)))
            elif isinstance(r.state, BlockRow):
                widths.append(len(self._columns(r.state)[0]))
            else:
                widths.append(self._first_unit(r)[1])
        return len(widths) * max(widths) if widths else 0

    def prefill_columns(self, request: Request) -> int:
        """Prompt columns a chunked prefill can compute ahead of the first step (module docstring): the history
        before the first attention block (the prompt's full blocks; the whole prompt under ``answer`` alignment),
        0 when that is nothing or, under ``block_causal`` with ``answer`` alignment, one bidirectional block."""
        if self.contract.attention == "block_causal" and self.contract.alignment == "answer":
            return 0
        return self._first_unit(request)[0]

    def _first_unit(self, request: Request) -> Unit:
        """The request's first sub-block and its attention block (``block_units``), from its prompt and settings."""
        context = getattr(self.model.config, "max_position_embeddings", None)
        p, n = request.answer_start, request.params.max_tokens
        return block_units(p, n, self.contract, request.params.block_length, context)[0]

    def _chunk_columns(self, request: Request) -> list[int]:
        """The prompt columns a prefilling request computes this step: ``prefill_chunk`` of them from
        ``num_computed`` on, rounded up to an attention block's end under ``block_causal`` (whose history columns
        see their whole block), at most ``prefill_target``; none for a paused prefill (a chunk of 0: ``_paused``)."""
        done, end = request.num_computed, request.num_computed + request.prefill_chunk
        if self.contract.attention == "block_causal":  # absolute alignment (``prefill_columns``): blocks from 0
            end = -(-end // self.contract.block_size) * self.contract.block_size
        return list(range(done, min(end, request.prefill_target)))

    def kv_rows(self, request: Request) -> int:
        """Rows of the KV store a request takes: one (its history's keys/values)."""
        return 1

    def _pending(self, row: BlockRow) -> bool:
        """Whether the row's next pass commits its block's first token alone (``first_token_pending``)."""
        return first_token_pending(self.contract, row.unit, row.request.canvas, self.mask_id)

    def _columns(self, row: BlockRow) -> tuple[list[int], list[int]]:
        """The canvas columns a row's pass computes and, per scored column of the sub-block, the index of the
        column whose hidden state scores it (``logits_shift``). A pending first token (``_pending``) is scored
        alone from the history, which that pass computes (and writes) up to the block. A prefilling row computes
        its chunk (``_chunk_columns``) and scores nothing."""
        if row.request.is_prefilling:
            return self._chunk_columns(row.request), []
        a, e, s, t = row.unit
        end, scored = (a, range(s, s + 1)) if self._pending(row) else (e, range(s, t))
        cols = list(range(row.cached_upto, end))
        shift = self.model.logits_shift
        if shift and s - shift < row.cached_upto:  # the history column that scores the block's first one
            cols = [s - shift, *cols]
        where = {c: i for i, c in enumerate(cols)}
        return cols, [where[c - shift] for c in scored]

    @torch.no_grad()
    def step(self, requests: list[Request]) -> list[Request]:
        """One pass for every request in ``requests`` (the running block-model requests): commit each row's
        chosen tokens, move it on or finish it; a prefilling row computes its chunk instead (``_prefilled``).
        Returns the requests that stepped (``requests`` less those prefilling; the state is updated in place)."""
        keep = set(requests)
        self.pool.release({r for r in self.requests if r in keep and not r.is_finished})
        for request in requests:
            if self.pool.row(request) is None and not request.is_finished:
                self._add(request)
        owners = self.requests
        prefilling = {r for r in owners if r.is_prefilling}  # they commit nothing and are not returned
        active = [i for i, r in enumerate(owners) if not self._paused(r)]
        if not active:
            return [r for r in requests if r not in prefilling]
        rows = [owners[i].state for i in active]
        total = self.pool.capacity_length
        canvas = torch.full((len(rows), total), self.pad_id, dtype=torch.long)
        columns, sources = [], []
        for i, row in enumerate(rows):
            canvas[i, : row.request.num_tokens] = row.request.canvas
            cols, src = self._columns(row)
            columns.append(cols)
            sources.append(src)
        window = column_window(columns, self.device)  # (R, Lw)
        starts = torch.tensor([row.unit[0] for row in rows], device=self.device)
        ends = torch.tensor([row.unit[1] for row in rows], device=self.device)
        origin = torch.tensor([0 if self.contract.alignment == "absolute" else row.request.answer_start
                               for row in rows], device=self.device)
        mask = layout_mask(window, total, starts, ends, origin, self.contract.block_size, self.contract.attention)
        cache, copied = self._pass_cache(active)
        hidden = self.entry.hidden_states(canvas.to(self.device), None, cache=cache, window=window,
                                          layout_mask=mask)  # (R, Lw, d)
        if copied is not None:  # the rows' fresh keys/values back into the pool
            for pooled, fresh in zip((*self.pool.keys, *self.pool.values), (*cache.keys, *cache.values), strict=True):
                pooled.index_copy_(0, copied, fresh)
        self.num_passes += 1
        self._prefilled([row for row in rows if row.request in prefilling])
        live = [i for i, row in enumerate(rows) if row.request not in prefilling]
        if live:
            widths = [len(sources[i]) for i in live]
            lb = max(widths)
            index = torch.tensor([sources[i] + sources[i][-1:] * (lb - len(sources[i])) for i in live],
                                 device=self.device)  # (R', Lb)
            live_hidden = hidden if len(live) == len(rows) else hidden[torch.tensor(live, device=self.device)]
            logits = self.entry.logits(gather_positions(live_hidden, index))  # (R', Lb, V)
            self._commit([rows[i] for i in live], logits, widths, lb)
        self.release_finished()  # a finished answer's keys/values go now, not at a later step that may never come
        return [r for r in requests if r not in prefilling]

    @staticmethod
    def _paused(request: Request) -> bool:
        """A prefill given no chunk this step (its running neighbours leave no room): its row sits the pass out."""
        return request.is_prefilling and request.prefill_chunk == 0

    def _pass_cache(self, active: list[int]) -> tuple[KVCache, torch.Tensor | None]:
        """The pool rows ``active`` (indices, ascending) as the pass's cache: a view of the pool when they are
        its first rows (every row, or paused prefills at the end), else a copy of them and their (R',) int64 index,
        for the caller to write the pass's keys/values back (``index_copy_``)."""
        n = len(active)
        if active[-1] == n - 1:
            return KVCache([k[:n] for k in self.pool.keys], [v[:n] for v in self.pool.values]), None
        index = torch.tensor(active, device=self.device)
        return KVCache([k.index_select(0, index) for k in self.pool.keys],
                       [v.index_select(0, index) for v in self.pool.values]), index

    def _prefilled(self, rows: list[BlockRow]) -> None:
        """Count the chunk each prefilling row's pass just wrote into its pool row: ``num_computed`` (and the
        row's ``cached_upto``) move past it, ``nfe`` counts the pass."""
        for row in rows:
            request = row.request
            request.num_computed += len(self._chunk_columns(request))
            request.nfe += 1
            row.cached_upto = request.num_computed

    @property
    def requests(self) -> list[Request]:
        """The requests this path holds (one KV-pool row each), in pool-row order."""
        return [r for r, _ in self.pool.owners]

    def release_finished(self) -> None:
        """Drop the KV-pool rows of finished or aborted requests (the pool's storage goes with its last row)."""
        self.pool.release({r for r in self.requests if not r.is_finished})

    release = release_finished  # the engine's mode-path interface

    def _commit(self, rows: list[BlockRow], logits: torch.Tensor, widths: list[int], lb: int) -> None:
        """Choose and commit each row's tokens (``denoise_step``, per-row settings), then advance the rows."""
        params = [row.request.params for row in rows]
        settings = RowSettings.from_params(params, self.device)
        block = torch.full((len(rows), lb), self.pad_id, dtype=torch.long)  # pad columns are never committed
        force = torch.zeros((len(rows), lb), dtype=torch.bool)
        pending = [self._pending(row) for row in rows]  # a first token committed alone (width 1)
        for i, row in enumerate(rows):
            s = row.unit[2]
            block[i, : widths[i]] = row.request.canvas[s : s + widths[i]]
            force[i, 0] = pending[i]
        num_tokens = torch.tensor([1 if pending[i] else int(row.schedule[min(row.step_in_unit, row.block_steps - 1)])
                                   for i, row in enumerate(rows)], device=self.device)
        history = History.of(settings, [row.request.canvas for row in rows], [row.request.answer for row in rows],
                             logits.shape[-1], self.mask_id, self.device, [row.request.ends(self.eos_id) for row in rows])
        step = commit_step(logits, block.to(self.device), self.mask_id, self.eos_id, self.banned_ids, num_tokens,
                           settings, [row.request.generator for row in rows], history, widths, self.confidence_from,
                           force=force.to(self.device) if force.any() else None)
        new, committed = step.block, step.committed
        if any(p.logprobs is not None for p in params):  # asking for nothing costs nothing
            entries = committed_entries(logits, new, committed, [p.logprobs for p in params], settings,
                                        self.banned_ids, history, None, self.logprobs_mode)
            for row, found in zip(rows, entries, strict=True):
                offset = row.unit[2] - row.request.answer_start
                n = row.request.params.max_tokens
                row.request.logprob_entries.update({offset + c: e for c, e in found.items() if offset + c < n})
        new, committed, stalled = new.cpu(), committed.cpu(), step.stalled.tolist()
        for i, row in enumerate(rows):
            self._advance(row, new[i, : widths[i]], committed[i, : widths[i]], pending[i], stalled[i])

    def _advance(self, row: BlockRow, new: torch.Tensor, committed: torch.Tensor, first_token: bool,
                 stalled: bool) -> None:
        """Write one row's step into its request; next sub-block, or finish (end of answer / early exit). After a
        ``first_token`` pass the sub-block's denoising steps start (its schedule is not advanced)."""
        request = row.request
        a, _, s, t = row.unit
        request.canvas[s : s + new.numel()] = new
        request.record_step()
        row.cached_upto = a  # this pass wrote the history before the block with its final tokens
        row.step_in_unit += 0 if first_token else 1
        if stalled:
            request.fail(NO_PROGRESS, f"denoising step {request.num_steps} committed no token (the model's scores for the "
                                      f"masked positions are not finite numbers), so the request was ended")
            return
        answer = request.answer.tolist()
        ends = request.ends(self.eos_id)
        if request.params.early_exit and end_reached(answer, ends, self.mask_id):
            request.finish("stop")  # the answer is final up to its end: no pass for the rest of the block
            return
        if bool((request.canvas[s:t] == self.mask_id).any()):
            return
        if row.unit_idx + 1 == len(row.units):
            request.finish("stop" if not ends.isdisjoint(answer) else "length")
            return
        row.unit_idx += 1
        row.start_unit()
