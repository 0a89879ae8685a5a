"""block_plan (documented rounding) and the linear transfer schedule."""

from __future__ import annotations

import math

import pytest
import torch

from celeris.sampling.schedule import block_plan, num_transfer_tokens


@pytest.mark.parametrize(
    ("max_new", "block", "steps", "bounds", "per_block"),
    [
        (16, 8, 8, [(0, 8), (8, 16)], 4),
        (13, 5, 7, [(0, 5), (5, 10), (10, 13)], 3),  # ceil(7 / 3)
        (10, 4, 20, [(0, 4), (4, 8), (8, 10)], 7),  # more steps than tokens: clamped later, per block
        (12, 4, 2, [(0, 4), (4, 8), (8, 12)], 1),  # fewer steps than blocks: at least one each
        (9, 32, 5, [(0, 9)], 5),  # block_length capped at max_tokens
    ],
)
def test_block_plan(max_new, block, steps, bounds, per_block):
    got_bounds, got_per_block = block_plan(max_new, block, steps)
    assert got_bounds == bounds
    assert got_per_block == per_block
    assert got_bounds[0][0] == 0 and got_bounds[-1][1] == max_new
    assert all(a[1] == b[0] for a, b in zip(got_bounds, got_bounds[1:], strict=False))


@pytest.mark.parametrize(("masked", "steps"), [(8, 4), (7, 3), (5, 5), (3, 1), (10, 4), (0, 3)])
def test_num_transfer_tokens_is_even_and_front_loaded(masked, steps):
    sched = num_transfer_tokens(torch.tensor([masked, masked]), steps)
    assert sched.shape == (2, steps)
    assert sched.dtype == torch.int64
    row = sched[0].tolist()
    assert sum(row) == masked
    assert max(row) - min(row) <= 1
    assert row == sorted(row, reverse=True)  # the remainder goes to the first steps
    assert row[0] == math.ceil(masked / steps)


def test_num_transfer_tokens_per_row():
    sched = num_transfer_tokens(torch.tensor([5, 2]), 3)
    assert sched.tolist() == [[2, 2, 1], [1, 1, 0]]
