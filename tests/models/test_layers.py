"""The one transformer (``celeris.models.layers``) on every format: the KV-cache interface.

A window pass after a full pass with unchanged tokens must give the full pass's logits (also for Dream, whose
logits at position i come from the hidden state at i-1, so its window starts one position earlier inside the
model); positions outside a window come from the cache; per-row column windows equal span windows.
"""

from __future__ import annotations

import pytest
import torch

from celeris.models import celeris as celeris_module
from celeris.models import layers
from celeris.models.loader import FORMATS, load_any
from celeris.sampling.cache import cache_window
from tests.models.conftest_formats import padded_batch, write_dream, write_llada

WRITERS = {"llada": write_llada, "dream": write_dream}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    WRITERS[request.param](folder, num_shards=1)
    return load_any(folder)


def test_every_format_is_the_one_transformer():
    """One transformer: every native format's model class is the shared TransformerLM with fused projections."""
    for fmt in FORMATS.values():
        assert issubclass(fmt.model_cls, layers.TransformerLM)
    assert celeris_module.CelerisModel.supports_kv_cache


@pytest.mark.parametrize("masked", [False, True])
def test_window_pass_after_full_pass_gives_full_logits(model, masked):
    ids, mask = padded_batch(model.config.vocab_size, pad=3, length=14)
    mask = mask if masked else None
    length = ids.shape[1]
    with torch.no_grad():
        full = model(ids, mask)  # (B, T, V), no cache
        for span, mode in [(slice(6, 10), "prefix"), (slice(6, 10), "dual"), (slice(0, 4), "dual"),
                           (slice(1, 5), "dual"), (slice(10, 14), "prefix"), (slice(13, 14), "dual"),
                           (slice(6, 10), "dual_delayed"), (slice(10, 14), "dual_delayed")]:
            # the span is block 1 of a plan whose block 0 is the 4 columns before it (block 0 when there is no room);
            # dual_delayed: a block's first step runs from the previous block to the end
            block_idx = 1 if span.start >= 4 else 0
            blocks = [(0, 4), (4, 4 + span.stop - span.start)] if block_idx else [(0, span.stop - span.start)]
            step = 0 if mode == "dual_delayed" else 1
            window = cache_window(mode, blocks, block_idx, span.start - 4 * block_idx, length, step_in_block=step)
            cache = layers.KVCache()
            filled = model(ids, mask, logits_slice=span, cache=cache)  # full pass fills the cache
            assert len(cache.keys) == len(model.layers)
            # the head over a slice is a GEMM of another shape: float32 noise of 1e-6 with one thread
            assert (filled - full[:, span]).abs().max() < 1e-5
            before = [k.clone() for k in cache.keys]
            got = model(ids, mask, logits_slice=span, cache=cache, window=window)
            assert got.shape == full[:, span].shape
            assert (got - full[:, span]).abs().max() < 1e-5, (span, mode)
            for old, new in zip(before, cache.keys, strict=True):  # written-back keys agree with the cached ones
                assert (old - new).abs().max() < 1e-5
            whole = model(ids, mask, cache=cache, window=window)  # no slice: the window's positions
            assert (whole - full[:, window[0] : window[1]]).abs().max() < 1e-5


def test_window_reads_cached_keys_outside_it(model):
    """Positions outside the window are not recomputed: their keys/values come from the cache."""
    ids, _ = padded_batch(model.config.vocab_size, pad=0, length=14)
    changed = ids.clone()
    changed[:, :4] = torch.flip(ids[:, :4], dims=[1])  # tokens left of the window (and of w0 - 1) change
    span = slice(8, 12)
    with torch.no_grad():
        cache = layers.KVCache()
        model(ids, cache=cache)
        stale = model(changed, logits_slice=span, cache=cache, window=(8, 12))
        fresh = model(ids, logits_slice=span)
    assert (stale - fresh).abs().max() < 1e-5  # the old tokens' cached keys were used


def test_logits_slice_must_lie_inside_the_window(model):
    ids, _ = padded_batch(model.config.vocab_size, pad=3, length=14)
    with torch.no_grad():
        cache = layers.KVCache()
        model(ids, cache=cache)
        with pytest.raises(ValueError, match="inside positions"):
            model(ids, logits_slice=slice(4, 10), cache=cache, window=(6, 10))


@pytest.mark.parametrize("first", [0, 1])
@pytest.mark.parametrize("fmt", ["celeris", "celeris-causal", "llada", "dream"])
def test_per_row_window_columns_equal_span_windows(tmp_path, fmt, first):
    """A (B, Lw) column window (each row its own span, padded by repeating its last column) gives, per row,
    the logits and written-back keys of that row's (w0, w1) window pass; a shifted model's (Dream, the causal
    twin) scoring of column c from the state at c - 1 is handled inside, whether c - 1 lies before the window
    (``first`` 0) or in it (``first`` 1)."""
    from tests.conftest import tiny_model

    if fmt.startswith("celeris"):
        net = tiny_model(is_causal=fmt == "celeris-causal")
    else:
        WRITERS[fmt](tmp_path, num_shards=1)
        net = load_any(tmp_path)
    ids, mask = padded_batch(net.config.vocab_size, pad=0, length=14)
    spans = [(6, 10), (9, 12)]  # different starts and widths
    with torch.no_grad():
        base = layers.KVCache()
        net(ids, mask, cache=base)
        lw = max(e - s for s, e in spans)
        cols = torch.stack([torch.arange(s, s + lw).clamp(max=e - 1) for s, e in spans])
        index = torch.tensor([[first, first + 1], [first, first + 1]])  # score two columns of each window
        per_row = layers.KVCache([k.clone() for k in base.keys], [v.clone() for v in base.values])
        got = net(ids, mask, cache=per_row, window=cols, logits_index=index)  # (B, 2, V)
        for row, (s, e) in enumerate(spans):
            alone = layers.KVCache([k[row : row + 1].clone() for k in base.keys],
                                   [v[row : row + 1].clone() for v in base.values])
            want = net(ids[row : row + 1], mask[row : row + 1], logits_slice=slice(s + first, s + first + 2),
                       cache=alone, window=(s, e))
            assert (got[row] - want[0]).abs().max() < 1e-4, (fmt, row)
            for a, b in zip(per_row.keys, alone.keys, strict=True):
                assert (a[row, :, s:e] - b[0, :, s:e]).abs().max() < 1e-4
