"""``celeris.engine.draft_rows.forward``: a prefill of ragged rows runs the head on the wanted columns only."""

from __future__ import annotations

import torch

from celeris.engine.draft_rows import forward, pass_mask
from celeris.models.layers import KVCache


def fresh_cache(model, rows: int, length: int) -> KVCache:  # noqa: ANN001
    cfg = model.config
    shape = (rows, cfg.num_heads, length, cfg.head_dim)
    zeros = [torch.zeros(shape, dtype=torch.float64) for _ in range(cfg.num_layers)]
    return KVCache(zeros, [z.clone() for z in zeros])


def test_a_ragged_prefill_scores_each_rows_last_columns_only(hybrid):
    """Rows of 9 and 4 prompt columns (the short one padded by repeating its last column, as the verified path
    pads): with ``first``/``last`` the head sees one column per row (it saw 6 before: from the short row's last
    column to the pass's end), and every wanted column's logits equal a full-head pass's; a padded column gets its
    row's last logits."""
    torch.manual_seed(1)
    lengths = [9, 4]
    cols = [list(range(n)) for n in lengths]
    width = max(lengths)
    columns = torch.tensor([c + c[-1:] * (width - len(c)) for c in cols])
    ids = torch.randint(3, hybrid.config.vocab_size, (2, width)).gather(1, columns)
    none = torch.full((2,), width)  # no mask slots: every column causal
    mask = pass_mask(columns, none, torch.zeros(2, dtype=torch.long), width)
    full = forward(hybrid, ids, fresh_cache(hybrid, 2, width), columns, mask)  # (2, Lw, V): the head on all

    seen = []
    logits = hybrid.logits

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(hidden.shape[:2]))
        return logits(hidden)

    hybrid.logits = spy
    try:
        first = last = [n - 1 for n in lengths]
        out = forward(hybrid, ids, fresh_cache(hybrid, 2, width), columns, mask, first, None, last)
    finally:
        del hybrid.logits
    assert seen == [(2, 1)]
    assert out.shape == full.shape
    torch.testing.assert_close(out[0, 8], full[0, 8])
    for p in range(3, width):  # the short row's last column and its padding
        torch.testing.assert_close(out[1, p], full[1, 3])
    # without ``last`` the rows are taken to run to the pass's end: the old span, the same wanted logits
    seen.clear()
    hybrid.logits = spy
    try:
        out = forward(hybrid, ids, fresh_cache(hybrid, 2, width), columns, mask, first)
    finally:
        del hybrid.logits
    assert seen == [(2, width - 3)]
    torch.testing.assert_close(out[0, 8], full[0, 8])
    torch.testing.assert_close(out[1, 3], full[1, 3])
