"""ModelRunner: owns the model and device; turns running requests into forward passes."""

from __future__ import annotations

import torch

from celeris.engine.request import Request
from celeris.models.celeris import KVCache
from celeris.sampling.step import guided


class ModelRunner:
    """Builds padded batches, runs the model once per step (plus CFG rows) and
    returns logits for each request's current block.

    Rows are padded so that every request's current block starts at the same
    column ("block-aligned" padding, left and right), with an attention mask: so
    padding is never attended, positions count real tokens only, and one cache
    window fits every row. Requests that read a KV cache this step (``prefix`` /
    ``dual``, after their block's first step) run in a separate window pass from
    those that need a full pass; each request keeps its own cache.
    """

    def __init__(self, model: torch.nn.Module, enforce_eager: bool = True, length_bucket: int = 1) -> None:
        # speed features are transforms applied here, never inside the model file
        self.model = model if enforce_eager else torch.compile(model, dynamic=True)
        self.length_bucket = length_bucket
        self.device = next(model.parameters()).device
        self.mask_id = model.config.mask_token_id
        self.pad_id = model.config.pad_token_id

    @torch.no_grad()
    def run(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """One denoising step's forward passes over ``requests``.

        Returns:
            logits (B, Lb, V) float32 for each request's current block (after CFG),
            and block (B, Lb) int64 current block tokens (columns past a short block
            hold the pad id, so they are never committed). Lb is the longest block.
        """
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            mode = r.params.cache if r.params.cache != "none" and r.step_in_block > 0 else "full"
            groups.setdefault(mode, []).append(i)
        lb = max(e - s for s, e in (r.block_span for r in requests))
        logits = block = None
        for mode, rows in groups.items():
            g_logits, g_block = self._forward([requests[i] for i in rows], mode, lb)
            if logits is None:
                logits = g_logits.new_empty((len(requests), lb, g_logits.shape[-1]))
                block = g_block.new_empty((len(requests), lb))
            logits[rows], block[rows] = g_logits, g_block
        return logits, block

    def _forward(self, requests: list[Request], mode: str, lb: int) -> tuple[torch.Tensor, torch.Tensor]:
        spans = [r.block_span for r in requests]
        align = max(s for s, _ in spans)  # every row's block starts at this column
        total = align + max(max(r.num_tokens - s for r, (s, _) in zip(requests, spans, strict=True)), lb)
        total = -(-total // self.length_bucket) * self.length_bucket  # right padding up to a bucket
        offsets = [align - s for s, _ in spans]
        b = len(requests)
        canvas = torch.full((b, total), self.pad_id, dtype=torch.long)
        attn = torch.zeros((b, total), dtype=torch.bool)
        is_answer = torch.zeros((b, total), dtype=torch.bool)
        for i, (r, off) in enumerate(zip(requests, offsets, strict=True)):
            canvas[i, off : off + r.num_tokens] = r.canvas
            attn[i, off : off + r.num_tokens] = True
            is_answer[i, off + r.answer_start : off + r.answer_start + r.params.max_new_tokens] = True
        canvas, attn, is_answer = canvas.to(self.device), attn.to(self.device), is_answer.to(self.device)
        cfg_rows = [i for i, r in enumerate(requests) if r.params.cfg_scale > 0]
        # unconditional rows for CFG: prompt and suffix replaced by the mask token
        uncond = torch.where(attn & ~is_answer, self.mask_id, canvas)[cfg_rows]
        batch_ids = torch.cat([canvas, uncond])
        batch_attn = torch.cat([attn, attn[cfg_rows]])
        span = slice(align, align + lb)
        window = {"full": None, "prefix": (align, total), "dual": (align, align + lb)}[mode]
        caching = any(r.params.cache != "none" for r in requests)
        cache = self._gather_cache(requests, cfg_rows, offsets, total) if window else KVCache() if caching else None
        kwargs = {} if cache is None else {"cache": cache, "window": window}
        logits = self.model(batch_ids, batch_attn, logits_slice=span, **kwargs)  # (B + C, Lb, V)
        if cache is not None and window is None:
            self._store_cache(requests, cfg_rows, offsets, cache)
        if cfg_rows:
            scale = torch.tensor([requests[i].params.cfg_scale for i in cfg_rows], device=self.device)[:, None]
            cond, uncond_logits = logits[cfg_rows], logits[b:]
            logits = logits[:b].clone()
            logits[cfg_rows] = guided(cond, uncond_logits, scale)
        widths = torch.tensor([e - s for s, e in spans], device=self.device)
        block = canvas[:, span]
        block = torch.where(torch.arange(lb, device=self.device)[None] < widths[:, None], block, self.pad_id)
        return logits[:b], block

    @staticmethod
    def _row_sources(requests: list[Request], cfg_rows: list[int]) -> list[tuple[Request, str]]:
        """Batch row -> (request, which cache): conditional rows first, then CFG rows."""
        return [(r, "kv") for r in requests] + [(requests[i], "kv_uncond") for i in cfg_rows]

    def _store_cache(self, requests: list[Request], cfg_rows: list[int], offsets: list[int], cache: KVCache) -> None:
        """Keep each request's unpadded slice of a full pass's keys/values (per layer (1, H, n, D))."""
        all_offsets = offsets + [offsets[i] for i in cfg_rows]
        for row, ((r, attr), off) in enumerate(zip(self._row_sources(requests, cfg_rows), all_offsets, strict=True)):
            if r.params.cache == "none":
                continue
            sl = slice(off, off + r.num_tokens)
            setattr(r, attr, KVCache([k[row : row + 1, :, sl] for k in cache.keys],
                                     [v[row : row + 1, :, sl] for v in cache.values]))

    def _gather_cache(
        self, requests: list[Request], cfg_rows: list[int], offsets: list[int], total: int
    ) -> KVCache:
        """Batch the requests' own caches into padded (B + C, H, total, D) tensors."""
        sources = self._row_sources(requests, cfg_rows)
        all_offsets = offsets + [offsets[i] for i in cfg_rows]
        first = getattr(sources[0][0], sources[0][1])
        out = KVCache()
        for layer in range(len(first.keys)):
            shape = (len(sources), *first.keys[layer].shape[1:2], total, first.keys[layer].shape[-1])
            keys = first.keys[layer].new_zeros(shape)
            values = first.values[layer].new_zeros(shape)
            for row, ((r, attr), off) in enumerate(zip(sources, all_offsets, strict=True)):
                own = getattr(r, attr)
                keys[row, :, off : off + r.num_tokens] = own.keys[layer][0]
                values[row, :, off : off + r.num_tokens] = own.values[layer][0]
            out.keys.append(keys)
            out.values.append(values)
        return out
