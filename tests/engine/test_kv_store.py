"""``celeris.engine.kv.KVStore``: one allocation whose rows every mode path takes as a contiguous segment; a
segment that grows moves the ones after it (their rows' contents and order kept), one that shrinks copies
nothing, and a full store refuses."""

from __future__ import annotations

import pytest

from celeris.engine.kv import KVStore, KVStoreFullError


def marks(segment) -> list[float]:
    """The marker each row of ``segment`` holds (every layer's keys and values of a row are filled with it)."""
    out = []
    for r in range(segment.num_rows):
        values = {float(t[r].flatten()[0]) for t in (*segment.keys, *segment.values)}
        assert len(values) == 1 and all(bool((t[r] == t[r].flatten()[0]).all()) for t in segment.keys)
        out.append(values.pop())
    return out


def fill(segment, row: int, mark: float) -> None:
    for t in (*segment.keys, *segment.values):
        t[row] = mark


def test_segments_grow_by_moving_the_later_ones_and_keep_their_rows(hybrid):
    store = KVStore(hybrid, num_rows=5, row_len=10)
    a, b, c = store.segment(), store.segment(), store.segment()
    assert store.nbytes == 0  # allocated at the first row taken
    for segment, first in ((b, 10.0), (c, 20.0)):
        segment.grow(2)
        fill(segment, 0, first)
        fill(segment, 1, first + 1)
    assert store.nbytes > 0 and (b.start, c.start) == (0, 2)
    a.grow(1)  # no room after a: b and c move one row on, in order
    fill(a, 0, 1.0)
    assert (a.start, b.start, c.start) == (0, 1, 3) and store.num_free_rows == 0
    assert (marks(a), marks(b), marks(c)) == ([1.0], [10.0, 11.0], [20.0, 21.0])
    with pytest.raises(KVStoreFullError, match="all taken"):
        b.grow(1)
    b.shrink(1)  # gives its last row back, copying nothing: a gap between b and c
    assert marks(b) == [10.0] and store.num_free_rows == 1 and c.start == 3
    c.grow(1)  # the gap is before c: every segment is packed (c moves left), then c takes the free row at the end
    fill(c, 2, 22.0)
    assert (a.start, b.start, c.start) == (0, 1, 2)
    assert (marks(a), marks(b), marks(c)) == ([1.0], [10.0], [20.0, 21.0, 22.0])
    with pytest.raises(ValueError, match="cannot give back 2"):
        a.shrink(2)
