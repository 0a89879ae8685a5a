"""ModelRunner: owns the model, the device and the running requests' KV caches; turns requests into forward passes."""

from __future__ import annotations

import torch

from celeris.engine.kv import KVPool
from celeris.engine.request import Request
from celeris.models.layers import KVCache, column_window
from celeris.sampling.cache import CACHE_MODES
from celeris.sampling.step import guided


class ModelRunner:
    """Runs one denoising step's forward passes and returns logits for each request's current block.

    A step makes at most two passes (plus CFG rows inside them):

    - a full pass for the requests that need one: no cache, a cache to fill (a
      new request) or to refresh (``prefix``/``dual`` at a block's first step,
      ``delayed``/``dual_delayed`` only as ``cache_refresh`` says).
      Rows are padded so every request's block starts at the same column
      ("block-aligned"), with an attention mask, so padding is never attended
      and positions count real tokens only. The keys/values are stored in the
      ``KVPool``.
    - one window pass over every live ``KVPool`` row: each row computes only its
      own columns (``Request.cache_columns``) and reads the rest from the pool in
      place. Rows that ran a full pass this step recompute their block
      harmlessly (those keys/values are recomputed before anyone reads them
      stale), which costs less than copying the others out.
    """

    def __init__(self, model: torch.nn.Module, enforce_eager: bool = True, length_bucket: int = 1) -> None:
        # speed features are transforms applied here, never inside the model file
        self.model = model if enforce_eager else torch.compile(model, dynamic=True)
        self.length_bucket = length_bucket
        self.device = next(model.parameters()).device
        self.mask_id = model.config.mask_token_id
        self.pad_id = model.config.pad_token_id
        self.pool = KVPool()
        self.num_split_passes = 0  # window steps run as a shared pass plus one for the wide rows (_window_pass)

    def release(self, keep: set[Request]) -> None:
        """Free the KV-cache rows of every request not in ``keep`` (finished or aborted)."""
        self.pool.release(keep)

    @torch.no_grad()
    def run(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """One denoising step's forward passes over ``requests``.

        Returns:
            logits (B, Lb, V) float32 for each request's current block (after CFG),
            and block (B, Lb) int64 current block tokens (columns past a short block
            hold the pad id, so they are never committed). Lb is the longest block.
        """
        self.release(set(requests))
        full = [i for i, r in enumerate(requests) if self._needs_full_pass(r)]
        windowed = sorted(set(range(len(requests))) - set(full))
        block_width = max(e - s for s, e in (r.block_span for r in requests))
        logits = block = None
        for rows, forward in ((full, self._full_pass), (windowed, self._window_pass)):
            if not rows:
                continue
            g_logits, g_block = forward([requests[i] for i in rows], block_width)
            if logits is None:
                logits = g_logits.new_empty((len(requests), block_width, g_logits.shape[-1]))
                block = g_block.new_empty((len(requests), block_width))
            logits[rows], block[rows] = g_logits, g_block
        return logits, block

    def _needs_full_pass(self, r: Request) -> bool:
        return not CACHE_MODES[r.params.cache].uses_cache or self.pool.row(r) is None or r.cache_columns() is None

    def _uncond(self, canvas: torch.Tensor, is_answer: torch.Tensor) -> torch.Tensor:
        """CFG's unconditional input: prompt and suffix replaced by the mask token."""
        return torch.where(is_answer, canvas, self.mask_id)

    def _block_tokens(self, canvas: torch.Tensor, starts: list[int], widths: list[int], block_width: int) -> torch.Tensor:
        """(B, block_width) tokens of each row's block from a (B, T) canvas; columns past a row's width hold the pad id."""
        cols = torch.tensor(starts)[:, None] + torch.arange(block_width)[None]
        block = canvas.gather(1, cols.clamp(max=canvas.shape[1] - 1))
        return torch.where(torch.arange(block_width)[None] < torch.tensor(widths)[:, None], block, self.pad_id)

    def _guide(self, requests: list[Request], logits: torch.Tensor, cond: list[int], uncond: list[int]) -> torch.Tensor:
        """Rows ``cond`` of ``logits`` for every request, CFG applied to the guided ones (rows ``uncond``)."""
        out = logits[cond]
        guided_rows = [i for i, r in enumerate(requests) if r.params.cfg_scale > 0]
        if guided_rows:
            scale = torch.tensor([requests[i].params.cfg_scale for i in guided_rows], device=self.device)[:, None]
            out = out.clone()
            out[guided_rows] = guided(out[guided_rows], logits[uncond], scale)
        return out

    def _full_pass(self, requests: list[Request], block_width: int) -> tuple[torch.Tensor, torch.Tensor]:
        spans = [r.block_span for r in requests]
        align = max(s for s, _ in spans)  # every row's block starts at this column
        total = align + max(max(r.num_tokens - s for r, (s, _) in zip(requests, spans, strict=True)), block_width)
        total = -(-total // self.length_bucket) * self.length_bucket  # right padding up to a bucket
        offsets = [align - s for s, _ in spans]
        b = len(requests)
        canvas = torch.full((b, total), self.pad_id, dtype=torch.long)
        attn = torch.zeros((b, total), dtype=torch.bool)
        is_answer = torch.zeros((b, total), dtype=torch.bool)
        for i, (r, off) in enumerate(zip(requests, offsets, strict=True)):
            canvas[i, off : off + r.num_tokens] = r.canvas
            attn[i, off : off + r.visible_end] = True  # the rest of the canvas: past the suffix window
            is_answer[i, off + r.answer_start : off + r.answer_start + r.params.max_tokens] = True
        uncond_rows = [i for i, r in enumerate(requests) if r.params.cfg_scale > 0]
        batch_ids = torch.cat([canvas, self._uncond(canvas, is_answer)[uncond_rows]]).to(self.device)
        batch_attn = torch.cat([attn, attn[uncond_rows]]).to(self.device)
        caching = any(r.params.cache != "none" for r in requests)
        cache = KVCache() if caching else None
        kwargs = {} if cache is None else {"cache": cache}
        columns = slice(align, align + block_width)
        logits = self.model(batch_ids, batch_attn, logits_slice=columns, **kwargs)  # (B + C, Lb, V)
        if cache is not None:
            sources = [(r, "cond") for r in requests] + [(requests[i], "uncond") for i in uncond_rows]
            for row, ((r, kind), off) in enumerate(zip(sources, offsets + [offsets[i] for i in uncond_rows], strict=True)):
                if r.params.cache != "none":
                    cols = slice(off, off + r.num_tokens)
                    self.pool.store(r, kind, [k[row, :, cols] for k in cache.keys], [v[row, :, cols] for v in cache.values])
        logits = self._guide(requests, logits, list(range(b)), list(range(b, b + len(uncond_rows))))
        widths = [e - s for s, e in spans]
        return logits, self._block_tokens(canvas, [align] * b, widths, block_width).to(self.device)

    def _window_pass(self, requests: list[Request], block_width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One window pass over every live pool row, or two when a few rows need far more columns than the rest.

        Per-row columns are padded to the widest row, so one row at a ``dual_delayed`` (or ``prefix``)
        block start, which recomputes the whole masked suffix, would make every other row compute that
        many columns too; with continuous batching (requests out of phase) or threshold decoding (blocks
        of different lengths in steps) that happens at almost every step. So when at most half the rows
        are wider than twice the block ("wide"), those first redo only their block in the shared pass,
        then run alone on a copy of their pool rows, which is written back (their block's keys/values are
        recomputed there, so the first pass's are never read).
        """
        pool = self.pool
        rows, total = pool.num_rows, pool.capacity_length
        canvas = torch.full((rows, total), self.pad_id, dtype=torch.long)
        attn = torch.zeros((rows, total), dtype=torch.bool)
        columns, block_starts = [], []
        for row, (r, kind) in enumerate(pool.owners):
            n = r.num_tokens
            ids = r.canvas
            if kind == "uncond":
                is_answer = torch.zeros(n, dtype=torch.bool)
                is_answer[r.answer_start : r.answer_start + r.params.max_tokens] = True
                ids = self._uncond(ids, is_answer)
            canvas[row, :n] = ids
            attn[row, : r.visible_end] = True
            # a row that ran a full pass this step just redoes its block
            cols, block_start = r.cache_columns() or (list(range(*r.block_span)), 0)
            columns.append(cols)
            block_starts.append(block_start)
        wide = [row for row, c in enumerate(columns) if len(c) > 2 * block_width]
        if not wide or 2 * len(wide) > rows:  # splitting pays (and copies at most half the pool) when few are wide
            logits = self._run_window(canvas, attn, pool.view(), columns, block_starts, block_width)
        else:
            shared, shared_starts = list(columns), list(block_starts)
            for row in wide:  # in the shared pass a wide row only redoes its block
                shared[row], shared_starts[row] = list(range(*pool.owners[row][0].block_span)), 0
            logits = self._run_window(canvas, attn, pool.view(), shared, shared_starts, block_width)
            self.num_split_passes += 1
            idx = torch.tensor(wide, device=self.device)
            sub = KVCache([k.index_select(0, idx) for k in pool.keys], [v.index_select(0, idx) for v in pool.values])
            logits[idx] = self._run_window(canvas[wide], attn[wide], sub, [columns[i] for i in wide],
                                           [block_starts[i] for i in wide], block_width)
            for layer in range(len(pool.keys)):
                pool.keys[layer].index_copy_(0, idx, sub.keys[layer])
                pool.values[layer].index_copy_(0, idx, sub.values[layer])
        cond = [pool.row(r) for r in requests]
        uncond = [pool.row(r, "uncond") for r in requests if r.params.cfg_scale > 0]
        logits = self._guide(requests, logits, cond, uncond)
        spans = [r.block_span for r in requests]
        block = self._block_tokens(canvas[cond], [s for s, _ in spans], [e - s for s, e in spans], block_width)
        return logits, block.to(self.device)

    def _run_window(self, canvas: torch.Tensor, attn: torch.Tensor, cache: KVCache, columns: list[list[int]],
                    block_starts: list[int], block_width: int) -> torch.Tensor:
        """A window pass: row i computes canvas columns ``columns[i]`` and scores the ``block_width`` of them from
        ``block_starts[i]`` on. canvas/attn (R, T) on the CPU, cache rows (R, ...). Returns (R, Lb, V) logits."""
        cols = column_window(columns)  # (R, Lw)
        width = torch.tensor([len(c) for c in columns])[:, None]
        index = torch.minimum(torch.tensor(block_starts)[:, None] + torch.arange(block_width)[None], width - 1)  # (R, Lb)
        return self.model(canvas.to(self.device), attn.to(self.device), cache=cache,
                          window=cols.to(self.device), logits_index=index.to(self.device))
