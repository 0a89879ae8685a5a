"""``celeris.engine.path.pad_groups``: the prefill passes of ragged prompts grouped so that each pads little."""

from __future__ import annotations

from celeris.engine.path import PAD_WASTE, pad_groups


def test_pad_groups_cover_every_row_once_and_each_pads_within_its_waste():
    widths = {0: 96, 1: 56, 2: 87, 3: 65, 4: 140, 5: 86, 6: 74, 7: 101}  # 8 GSM8K prompts of the bench, tokens
    groups = pad_groups(widths)
    assert sorted(i for g in groups for i in g) == sorted(widths)
    assert all(g == sorted(g) for g in groups)
    for g in groups:  # a pass pads every row to its widest
        assert len(g) * max(widths[i] for i in g) <= (1 + PAD_WASTE) * sum(widths[i] for i in g)
    padded = sum(len(g) * max(widths[i] for i in g) for g in groups)
    assert padded < 8 * 140  # fewer columns than one pass over all eight
    assert len(groups) < len(widths)  # rows of near widths share a pass


def test_pad_groups_keep_rows_of_one_width_in_one_pass_and_split_far_widths():
    assert pad_groups({3: 10, 1: 10, 2: 10}) == [[1, 2, 3]]
    assert pad_groups({0: 10, 1: 100}) == [[0], [1]]
    assert pad_groups({}) == []
    assert pad_groups({0: 10, 1: 11}, waste=0.0) == [[0], [1]]
