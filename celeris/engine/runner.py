"""ModelRunner: owns the model and device; turns running requests into one forward pass."""

from __future__ import annotations

import torch

from celeris.engine.request import Request
from celeris.sampling.step import guided


class ModelRunner:
    """Builds the padded batch, runs the model once per step (plus CFG rows) and
    returns logits for each request's current block.

    Rows are left-padded to the longest canvas with an attention mask, so padding
    is never attended and positions count real tokens only.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.mask_id = model.config.mask_token_id
        self.pad_id = model.config.pad_token_id

    @torch.no_grad()
    def run(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward pass over ``requests``.

        Returns:
            logits (B, Lb, V) float32 for each request's current block (after CFG),
            block (B, Lb) int64 current block tokens (padding columns hold the pad
            id, so they are never committed), and
            widths (B,) int64 block length of each row. Lb is the longest block.
        """
        b = len(requests)
        total = max(r.num_tokens for r in requests)
        canvas = torch.full((b, total), self.pad_id, dtype=torch.long)
        attn = torch.zeros((b, total), dtype=torch.bool)
        starts, widths = [], []
        for i, r in enumerate(requests):
            offset = total - r.num_tokens
            canvas[i, offset:] = r.canvas
            attn[i, offset:] = True
            s, e = r.block_span
            starts.append(offset + s)
            widths.append(e - s)
        lb = max(widths)
        first, last = min(starts), max(s + lb for s in starts)
        last = min(last, total)
        canvas, attn = canvas.to(self.device), attn.to(self.device)
        cfg_rows = [i for i, r in enumerate(requests) if r.params.cfg_scale > 0]
        if cfg_rows:  # unconditional rows: prompt and suffix replaced by the mask token
            uncond = canvas[cfg_rows].clone()
            for j, i in enumerate(cfg_rows):
                r = requests[i]
                offset = total - r.num_tokens
                is_answer = torch.zeros(total, dtype=torch.bool, device=self.device)
                is_answer[offset + r.answer_start : offset + r.answer_start + r.params.max_new_tokens] = True
                uncond[j] = torch.where(attn[i] & ~is_answer, self.mask_id, uncond[j])
            canvas = torch.cat([canvas, uncond])
            attn = torch.cat([attn, attn[cfg_rows]])
        logits = self.model(canvas, attn, logits_slice=slice(first, last))  # (B', U, V)
        cols = torch.tensor(starts, device=self.device)[:, None] - first + torch.arange(lb, device=self.device)
        cols = cols.clamp(max=last - first - 1)  # (B, Lb); columns past a short block are ignored below
        if cfg_rows:
            cond, uncond_logits = logits[cfg_rows], logits[b:]
            scale = torch.tensor([requests[i].params.cfg_scale for i in cfg_rows], device=self.device)[:, None]
            logits = logits[:b].clone()
            logits[cfg_rows] = guided(cond, uncond_logits, scale)
        logits = logits[:b].gather(1, cols[..., None].expand(-1, -1, logits.shape[-1]))  # (B, Lb, V)
        block = canvas[:b].gather(1, cols + first)
        width = torch.tensor(widths, device=self.device)
        block = torch.where(torch.arange(lb, device=self.device)[None] < width[:, None], block, self.pad_id)
        return logits, block, width
