"""The CPU fast pass's small operators (celeris.models.fast_ops, kernels/decode_ops.c) against PyTorch's own:
RMSNorm, silu(gate) * up, SDPA with grouped K/V heads and masks, and the fused RoPE + cache write + attention step
against ``Attention.forward``'s PyTorch path on a tiny layer; a whole model with the fast operators computes what
it computes without them, and a query's attention does not depend on the other queries of its pass (the verified
path's widths)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

from celeris.models import fast_ops, kernels
from celeris.models.layers import (
    Architecture,
    Attention,
    KVCache,
    TransformerLM,
    causal_mask,
    column_window,
    positions_and_mask,
)
from celeris.models.rope import rope_cos_sin

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no C compiler: the fast operators are off")


def test_rms_norm_and_silu_mul_equal_pytorchs():
    x, w = torch.randn(3, 5, 96) * 4, torch.randn(96)
    torch.testing.assert_close(fast_ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (96,), w, 1e-5), rtol=1e-5, atol=1e-5)
    gu = torch.randn(4, 2, 2 * 80) * 6
    gu[0, 0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0])  # exp's clamps and zero
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(fast_ops.silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    assert fast_ops.rms_norm(x.double(), w.double(), 1e-5) is None  # another dtype: PyTorch's path


def reference_attention(q, k, v, mask):  # noqa: ANN001, ANN201
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # (B, H, Lq, D)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


@pytest.mark.parametrize("mask_kind", ["none", "per-row", "shared", "2d"])
def test_attention_equals_sdpa(mask_kind):
    b, h, hkv, lq, t, d = 2, 6, 2, 5, 37, 32
    q, k, v = torch.randn(b, h, lq, d), torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    k_view = torch.randn(b, hkv, t + 9, d)[:, :, :t]  # a strided view of a longer cache, as the engine's store
    k_view.copy_(k)
    mask = {"none": None, "per-row": torch.rand(b, 1, lq, t) > 0.3, "shared": torch.rand(1, 1, lq, t) > 0.3,
            "2d": torch.rand(lq, t) > 0.3}[mask_kind]
    if mask is not None:
        mask[..., 0] = True  # every query attends somewhere (SDPA gives NaN for none)
    got = fast_ops.attention(q, k_view, v, mask, is_causal=False)
    torch.testing.assert_close(got, reference_attention(q, k, v, mask), rtol=1e-4, atol=1e-5)
    if mask is None:  # SDPA's causal flag (a prefill: T = Lq here, and T > Lq)
        for keys in (lq, t):
            want = F.scaled_dot_product_attention(q, k[:, :, :keys], v[:, :, :keys], is_causal=True, enable_gqa=True)
            if keys > lq:  # SDPA aligns its causal mask top-left: the reference is the bottom-right mask
                bottom_right = torch.ones(lq, keys, dtype=torch.bool).tril(keys - lq)
                want = F.scaled_dot_product_attention(q, k, v, attn_mask=bottom_right, enable_gqa=True)
            got = fast_ops.attention(q, k[:, :, :keys], v[:, :, :keys], None, is_causal=True)
            torch.testing.assert_close(got, want.transpose(1, 2).reshape(b, lq, -1), rtol=1e-4, atol=1e-5)


def test_a_query_does_not_depend_on_the_other_queries_nor_on_padding():
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    full = fast_ops.attention(q, k, v, None, is_causal=False)
    alone = fast_ops.attention(q[:, :, 3:4], k, v, None, is_causal=False)
    assert torch.equal(full[:, 3:4], alone)  # bit for bit: verified decoding's widths give next-token's numbers
    pad = 5  # the same row left-padded by 5 masked keys (a batch's shorter prompt)
    kp, vp = torch.cat([torch.randn(1, 2, pad, 16), k], 2), torch.cat([torch.randn(1, 2, pad, 16), v], 2)
    mask = torch.ones(1, 1, 8, 20 + pad, dtype=torch.bool)
    mask[..., :pad] = False
    assert torch.equal(fast_ops.attention(q, kp, vp, mask, is_causal=False), full)


@pytest.mark.parametrize("d", [64, 80, 24])  # whole vectors of dimensions, a tail, no whole vector
def test_a_long_causal_prefill_equals_sdpa_and_each_query_is_computed_alone(d):
    q, k, v = torch.randn(1, 6, 300, d), torch.randn(1, 2, 300, d), torch.randn(1, 2, 300, d)
    got = fast_ops.attention(q, k, v, None, is_causal=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(1, 300, -1), rtol=1e-4, atol=1e-5)
    for i in (0, 17, 150, 299):  # query i alone over its keys: the prefill's numbers, bit for bit
        alone = fast_ops.attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], None, is_causal=False)
        assert torch.equal(got[:, i:i + 1], alone), i


def test_every_code_path_of_the_attention_rounds_alike(variants, monkeypatch):
    """The AVX-512 loops (fused multiply-adds in vector lanes) give the plain C loops' numbers, bit for bit."""
    q, k, v = torch.randn(2, 6, 40, 80), torch.randn(2, 2, 70, 80), torch.randn(2, 2, 70, 80)
    mask = torch.rand(2, 1, 40, 70) > 0.4
    mask[..., 0] = True
    outs = {}
    for name, lib in variants.items():
        monkeypatch.setattr(kernels, "library", lambda lib=lib: lib)
        outs[name] = fast_ops.attention(q, k, v, mask, is_causal=False)
    assert all(torch.equal(o, outs["plain"]) for o in outs.values()), list(outs)


def tiny_arch(**kw: object) -> Architecture:
    base = dict(vocab_size=50, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                intermediate_size=96, rms_norm_eps=1e-6, rope_theta=10000.0, is_causal=True, logits_shift=1)
    return Architecture(**{**base, **kw})


@pytest.mark.parametrize("window_kind", ["span", "columns"])
def test_rope_cache_attention_equals_the_layers_pytorch_path(window_kind):
    torch.manual_seed(0)
    layer = Attention(tiny_arch(qkv_bias=True)).eval()
    b, t = 2, 12
    positions = torch.arange(t)[None].expand(b, t)
    cos, sin = rope_cos_sin(positions, 16, 10000.0)
    x = torch.randn(b, t, 64)
    caches = [KVCache([torch.randn(b, 2, t, 16)], [torch.randn(b, 2, t, 16)]) for _ in range(2)]
    caches[1].keys[0].copy_(caches[0].keys[0])
    caches[1].values[0].copy_(caches[0].values[0])
    if window_kind == "span":
        window, cols = (8, 11), torch.arange(8, 11)[None].expand(b, 3)
    else:
        window = cols = column_window([[5, 9, 10], [3, 4, 4]])  # the second row pads by repeating a column
    mask = torch.arange(t)[None, None, None, :] <= cols[:, None, :, None]  # (B, 1, Lq, T) causal per column
    xs, c, s = x.gather(1, cols[..., None].expand(-1, -1, 64)), cos.gather(2, cols[:, None, :, None].expand(
        -1, -1, -1, 16)), sin.gather(2, cols[:, None, :, None].expand(-1, -1, -1, 16))
    with torch.no_grad():
        want = layer(xs, c, s, mask, cache=caches[0], layer_idx=0, window=window)
        layer.fast = True
        got = layer(xs, c, s, mask, cache=caches[1], layer_idx=0, window=window)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # the same writes, bit for bit: RoPE in C rounds as PyTorch's does, so a pass on either path leaves the same
    # keys (the verified and the next-token paths may reach the cache through different ones)
    assert torch.equal(caches[1].keys[0], caches[0].keys[0]) and torch.equal(caches[1].values[0], caches[0].values[0])


def test_a_model_with_the_fast_operators_computes_the_same_logits():
    class Config:
        def architecture(self) -> Architecture:
            return tiny_arch()

    torch.manual_seed(0)
    model = TransformerLM(Config()).eval()
    ids = torch.randint(0, 50, (2, 14))
    attn = torch.ones(2, 14, dtype=torch.bool)
    attn[1, :3] = False  # a left-padded row
    outputs = []
    for fast in (False, True):
        for m in model.modules():
            if hasattr(m, "fast"):
                m.fast = fast
        cache = KVCache()
        with torch.no_grad():
            model.hidden_states(ids, attn, cache)  # a full pass (SDPA either way) fills the cache
            step = model.hidden_states(ids, attn, cache, (10, 13))  # a window pass: the fast operators
        outputs.append(model.logits(step))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)
    assert fast_ops.enable(model) and all(m.fast for m in model.modules() if hasattr(m, "fast"))


def q8_0_model() -> TransformerLM:
    """A tiny random Llama whose every linear is Q8_0 blocks on the kernel (gguf-py's quantizer), seed 0."""
    from celeris.models.blocks import quantize_linears

    class Config:
        def architecture(self) -> Architecture:
            return tiny_arch(hidden_size=64, intermediate_size=96)

    torch.manual_seed(0)
    model = TransformerLM(Config()).eval()
    for block in model.layers:
        quantize_linears(block, "Q8_0")
    return model


def test_a_whole_block_kernel_layer_in_one_call_equals_its_modules_bit_for_bit(monkeypatch):
    """``celeris_decoder_layer`` (``Block.fused``): a model whose linears are Q8_0 blocks computes, for cached window
    passes (a span and per-row columns), the same hidden states and the same cache writes as the fast operators
    called module by module."""
    model = q8_0_model()
    assert fast_ops.enable(model) and all(b.fused for b in model.layers)
    ids = torch.randint(0, 50, (2, 14))
    attn = torch.ones(2, 14, dtype=torch.bool)
    attn[1, :3] = False  # a left-padded row
    calls, real = [], fast_ops.decoder_layer

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = real(*args, **kwargs)
        calls.append(out is not None)  # None: not a window pass, the modules compute it
        return out

    monkeypatch.setattr(fast_ops, "decoder_layer", counted)
    model.layer_stack = None  # layer by layer here (the one call for all layers: the next test)
    runs = []
    for fused in (False, True):
        for b in model.layers:
            b.fused = fused
        cache = KVCache()
        with torch.no_grad():
            model.hidden_states(ids, attn, cache)  # a full pass fills the cache (no window: the modules either way)
            span = model.hidden_states(ids, attn, cache, (10, 13))
            cols = model.hidden_states(ids, attn, cache, column_window([[11, 12, 13], [9, 12, 12]]))
        runs.append((span, cols, [k.clone() for k in cache.keys], [v.clone() for v in cache.values]))
    (span0, cols0, k0, v0), (span1, cols1, k1, v1) = runs
    assert sum(calls) == 2 * len(model.layers)  # the fused run's two window passes, every layer in one call
    assert torch.equal(span1, span0) and torch.equal(cols1, cols0)
    assert all(torch.equal(a, b) for a, b in zip(k0 + v0, k1 + v1, strict=True))
    model.layers[0].attn.q_norm = torch.nn.Identity()  # a q/k norm: the one-call kernel does not take it
    assert not fast_ops.fused_layer_fits(model.layers[0]) and fast_ops.fused_layer_fits(model.layers[1])


def test_every_layer_in_one_call_equals_the_layer_calls_bit_for_bit(monkeypatch):
    """``celeris_decoder_stack`` (``TransformerLM.layer_stack``): the same hidden states, cache writes and captured
    layer outputs (a drafter's features) as one ``celeris_decoder_layer`` call a layer, for a span and per-row
    columns; a layer switched off its kernel sends the pass back to the layer loop."""
    model = q8_0_model()
    assert fast_ops.enable(model) and model.layer_stack is not None
    stack = model.layer_stack
    calls, real = [], fast_ops.LayerStack.__call__

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(fast_ops.LayerStack, "__call__", counted)
    ids = torch.randint(0, 50, (2, 14))
    attn = torch.ones(2, 14, dtype=torch.bool)
    attn[1, :3] = False
    positions, mask = positions_and_mask(ids, attn)
    window = column_window([[11, 12, 13], [9, 12, 12]])
    runs = []
    for one_call in (False, True):
        model.layer_stack = stack if one_call else None
        cache = KVCache()
        capture = {0: None, len(model.layers) - 1: None}
        with torch.no_grad():
            model.hidden_states(ids, attn, cache)  # a full pass: the layer loop either way
            span = model.hidden_states(ids, attn, cache, (10, 13))
            cols = model.layout_hidden_states(ids.gather(1, window), positions.gather(1, window),
                                              mask & causal_mask(14, window, ids.device), cache, window, capture)
        runs.append((span, cols, capture, [k.clone() for k in cache.keys], [v.clone() for v in cache.values]))
    (span0, cols0, cap0, k0, v0), (span1, cols1, cap1, k1, v1) = runs
    assert calls.count(True) == 2  # the one-call run's two window passes
    assert torch.equal(span1, span0) and torch.equal(cols1, cols0)
    assert list(cap0) == list(cap1) and all(torch.equal(cap0[i], cap1[i]) for i in cap0)
    assert all(torch.equal(a, b) for a, b in zip(k0 + v0, k1 + v1, strict=True))
    twin = copy.deepcopy(model)  # a deep copy's stack reads the copy's weights, whatever becomes of the original
    assert twin.layer_stack.blocks[0] is twin.layers[0]
    assert int(twin.layer_stack.table[0, 3]) == twin.layers[0].attn.qkv_proj.tiles.data_ptr()
    model.layers[1].fused = False  # one layer off its kernel: the stack declines, the layer loop computes
    with torch.no_grad():
        again = model.hidden_states(ids, attn, cache, (10, 13))
    assert calls[-1] is False and torch.equal(again, span0)


def test_argmax_equals_torchs_on_ties_nans_infinities_and_signed_zeros_on_every_build(variants):
    """The kernel's argmax takes the first largest value, a NaN counting as the largest, as ``torch.argmax`` does,
    on every code path (vector bodies and scalar tails: rows of 49,152, 37 and 5 values)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in (49152, 37, 5):
        x = torch.randn(8, n, generator=g)
        x[1, n // 3], x[1, n - 1] = 50.0, 50.0  # a tie: the first wins
        x[2, n // 2], x[2, 1] = float("nan"), float("nan")  # NaNs: the first NaN
        x[3] = float("-inf")  # all -inf: index 0
        x[4, 0], x[4, n - 1] = float("inf"), float("inf")
        x[5] = 0.0
        x[5, n // 2] = -0.0  # signed zeros are equal: the first
        x[6, : n // 2] = -1.0
        x[6, n // 2 :] = 0.0  # the largest only in the tail half
        x[7, -1] = 9.0  # the largest last (in a scalar tail where n is not a multiple of the vector)
        rows.append(x)
    for name, lib in variants.items():
        for x in rows:
            out = torch.empty(8, dtype=torch.long)
            lib.celeris_argmax_rows(kernels.pointer(x), 8, x.shape[1], kernels.pointer(out))
            assert torch.equal(out, x.argmax(-1)), (name, x.shape[1])
    for x in rows:  # the wrapper, any leading shape, and torch's own path for what the kernel does not take
        assert torch.equal(fast_ops.argmax(x.reshape(2, 4, -1)), x.reshape(2, 4, -1).argmax(-1))
        assert torch.equal(fast_ops.argmax(x[0]), x[0].argmax(-1))
        assert torch.equal(fast_ops.argmax(x.double()), x.double().argmax(-1))


def test_the_drafter_stack_equals_the_drafters_modules_bit_for_bit():
    """A DFlash drafter on the block kernel (Q8_0 projections, fused gate/up, the fast operators) gives the same
    block hidden states and the same cached keys/values with its layers in one kernel call (``DraftStack``) as
    through its modules, over two calls (the second reads the first's context from the bound cache)."""
    from celeris.models import blocks
    from celeris.models.dflash import DFlashConfig, DFlashDraftModel, DFlashMLP, DraftKVCache

    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=50, num_target_layers=6, block_size=4,
                       rope_theta=10000.0, mask_token_id=3, target_layer_ids=[1, 4])
    model = DFlashDraftModel(cfg).eval()
    for m in model.modules():
        if isinstance(m, DFlashMLP):
            m.fuse()
    blocks.quantize_linears(model, "Q8_0")
    assert fast_ops.enable(model) and model.draft_stack is not None
    real, ran, caches = model.draft_stack, [], []

    def stack(*args: object) -> torch.Tensor | None:  # the stack, noting whether it computed (not fell back)
        out = real(*args)
        ran.append(out is not None)
        return out

    for stacked in (True, False):
        model.draft_stack, cache, outs = stack if stacked else None, DraftKVCache(), []
        cache.bind(*model.cache_buffers(1, 32))
        for start, new in ((5, 5), (9, 4)):  # two calls: 5 context columns, then 4 more
            feats = torch.randn(1, new, 2 * cfg.hidden_size, generator=torch.Generator().manual_seed(start))
            block = torch.randn(1, cfg.block_size, cfg.hidden_size, generator=torch.Generator().manual_seed(start + 1))
            positions = torch.arange(cache.length, start + cfg.block_size)[None]
            outs.append(model(block, feats, positions, cache))
            cache.crop(start)
        caches.append((outs, [k.clone() for k in cache.keys], [v.clone() for v in cache.values], cache.length))
    (a, ka, va, la), (b, kb, vb, lb) = caches
    assert ran == [True, True] and la == lb == 9
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(torch.equal(x[:, :, :9], y[:, :, :9]) for x, y in zip(ka + va, kb + vb, strict=True))
    assert float(a[1].abs().max()) > 0
    twin = copy.deepcopy(model)  # a copy's stack reads the copy's weights (its table holds their addresses)
    twin.draft_stack = copy.deepcopy(real, {id(layer): c for layer, c in zip(model.layers, twin.layers, strict=True)})
    ours = {t.data_ptr() for t in twin.draft_stack._held}
    assert ours.isdisjoint(t.data_ptr() for t in real._held)
    assert ours == {t.data_ptr() for b in twin.layers for t in (
        b.input_layernorm.weight, b.post_attention_layernorm.weight, b.self_attn.q_norm.weight,
        b.self_attn.k_norm.weight, *(x.tiles for x in (b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj,
                                                       b.self_attn.o_proj, b.mlp.gate_up_proj, b.mlp.down_proj)))}


def test_penalized_argmax_equals_the_penalties_the_ban_and_torchs_argmax_on_every_build(variants):
    """``celeris_penalized_argmax`` (greedy next-token decoding's commit in one pass) gives the ids and values of
    ``apply_penalties`` (frequency, presence: OpenAI's), then the banned ids at -inf, then ``torch.argmax``: with
    ties the penalties make, NaNs, infinities, a banned largest value, negative penalties, on every code path."""
    from celeris.sampling.params import SamplingParams
    from celeris.sampling.step import History, RowSettings, apply_penalties

    g = torch.Generator().manual_seed(1)
    for n in (49152, 37):
        x = torch.randn(6, n, generator=g)
        counts = torch.randint(0, 4, (6, n), generator=g).float()
        x[1, 3], counts[1, 3] = 99.0, 0.0  # the largest, banned below
        x[2, n // 2] = float("nan")
        x[3, : n // 2] = float("-inf")
        x[4, 7], x[4, 9], counts[4, 7], counts[4, 9] = 5.4, 5.2, 1.0, 0.0  # 5.4 - 0.2 * 1 ties 5.2 (or nearly)
        x[5, 0] = float("inf")
        banned = [3, n - 1]
        for fp, pp in ((0.2, 0.0), (0.0, 0.5), (0.3, -0.4), (0.0, 0.0)):
            rows = [SamplingParams(frequency_penalty=fp, presence_penalty=pp)] * 6
            settings = RowSettings.from_params(rows, torch.device("cpu"))
            want = apply_penalties(x[:, None].clone(), settings, History(None, counts))[:, 0]
            want[:, banned] = float("-inf")
            freq = torch.full((6,), fp) if fp else None
            pres = torch.full((6,), pp) if pp else None
            uses = freq is not None or pres is not None
            for name, lib in variants.items():
                ids, values, scratch = torch.empty(6, dtype=torch.long), torch.empty(6), torch.empty(n)
                b = torch.tensor(banned)
                lib.celeris_penalized_argmax(kernels.pointer(x), 6, n, kernels.pointer(counts) if uses else None,
                                             n, None if freq is None else kernels.pointer(freq),
                                             None if pres is None else kernels.pointer(pres), None, kernels.pointer(b), 2,
                                             kernels.pointer(scratch), kernels.pointer(ids), kernels.pointer(values))
                assert torch.equal(ids, want.argmax(-1)), (name, n, fp, pp)
                chosen = want.gather(1, ids[:, None])[:, 0]  # its penalized logit (NaN where a NaN won)
                assert torch.equal(values.nan_to_num(7.0), chosen.nan_to_num(7.0)), (name, n, fp, pp)
            got = fast_ops.penalized_argmax(x, counts if uses else None, freq, pres, banned)
            assert got is not None and torch.equal(got[0], want.argmax(-1))
    assert fast_ops.penalized_argmax(x.double(), None, None, None, []) is None  # not the kernel's: torch's path


def test_penalized_argmax_along_drafts_equals_penalize_along_then_torchs_argmax_on_every_build(variants):
    """With one row of counts for all positions and per-position extra counts (verified decoding's positions after
    each draft), the kernel gives the argmax of ``penalize_along`` after the ban, on every code path: drafts that
    repeat a token, a draft that is the top logit, penalties of either sign."""
    from celeris.sampling.params import SamplingParams
    from celeris.sampling.step import History, RowSettings
    from celeris.sampling.verified import penalize_along

    g = torch.Generator().manual_seed(2)
    n = 49152
    for drafts in ([5, 9, 5, 11, 5, 2, 9], [], [42], [7, 7, 7]):
        m = len(drafts)
        x = torch.randn(m + 1, n, generator=g)
        counts = torch.randint(0, 3, (1, n), generator=g).float()
        x[:, 5] = 3.9  # a repeated draft near the top: its extra counts decide the argmax
        x[:, 42] = 4.1
        x[:, 7] = 4.0
        banned = [3, n - 1]
        x[:, 3] = 99.0
        for fp, pp in ((0.2, 0.0), (0.0, 0.5), (0.3, -0.4), (-0.5, 0.0)):
            settings = RowSettings.from_params([SamplingParams(frequency_penalty=fp, presence_penalty=pp)],
                                               torch.device("cpu"))
            banned_x = x.clone()
            banned_x[:, banned] = float("-inf")
            want = penalize_along(banned_x, History(None, counts.clone()), drafts, settings).argmax(-1)
            extra = [sorted((t, drafts[:p].count(t)) for t in set(drafts[:p])) for p in range(m + 1)]
            freq = torch.tensor([fp]) if fp else None
            pres = torch.tensor([pp]) if pp else None
            got = fast_ops.penalized_argmax(x, counts, freq, pres, banned, extra)
            assert got is not None and torch.equal(got[0], want), (drafts, fp, pp)
            table = torch.tensor([0, *itertools.accumulate(len(e) for e in extra), *(t for e in extra for t, _ in e),
                                  *(c for e in extra for _, c in e)])  # offsets, tokens, counts
            b = torch.tensor(banned)
            fr, pr = (None if t is None else t.expand(m + 1).contiguous() for t in (freq, pres))  # kept alive
            for name, lib in variants.items():
                ids, values, scratch = torch.empty(m + 1, dtype=torch.long), torch.empty(m + 1), torch.empty(n)
                lib.celeris_penalized_argmax(
                    kernels.pointer(x), m + 1, n, kernels.pointer(counts), 0,
                    None if fr is None else kernels.pointer(fr), None if pr is None else kernels.pointer(pr),
                    kernels.pointer(table), kernels.pointer(b), 2,
                    kernels.pointer(scratch), kernels.pointer(ids), kernels.pointer(values))
                assert torch.equal(ids, want), (name, drafts, fp, pp)
    assert fast_ops.penalized_argmax(x, None, None, None, [], [[]] * (m + 1)) is None  # extras need counts


def test_greedy_next_token_commits_as_the_full_sampler_does():
    """``greedy_single`` (the kernel's one pass) commits what ``prepare_logits`` + ``sample_tokens`` +
    ``commit_single`` commit for a one-column block, with and without penalties; it steps aside (None) for sampling,
    a repetition penalty, or a chosen logit that is not finite."""
    from celeris.sampling.params import SamplingParams
    from celeris.sampling.select import sample_tokens
    from celeris.sampling.step import History, RowSettings, commit_single, greedy_single, prepare_logits

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 1, 300, generator=g)
    counts = torch.randint(0, 3, (4, 300), generator=g).float()
    block = torch.tensor([[1], [1], [7], [1]])  # row 2 already committed
    num = torch.ones(4, dtype=torch.long)
    for params in (SamplingParams(frequency_penalty=0.2), SamplingParams(presence_penalty=0.7), SamplingParams()):
        settings = RowSettings.from_params([params] * 4, torch.device("cpu"))
        history = History(None, counts) if settings.any_count_penalty else None
        got = greedy_single(logits, block, 1, [1, 2], num, settings, history, "filtered")
        filtered, _ = prepare_logits(logits, settings, [1, 2], history)
        x0 = sample_tokens(filtered, settings.temperature, [None] * 4, None, settings.any_sampling)
        want = commit_single(filtered, x0, block, 1, num, settings, "filtered")
        assert got is not None and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for params in (SamplingParams(temperature=0.7), SamplingParams(repetition_penalty=1.2)):
        assert greedy_single(logits, block, 1, [1, 2], num, RowSettings.from_params([params] * 4, torch.device("cpu")),
                             None, "filtered") is None
    settings = RowSettings.from_params([SamplingParams()] * 4, torch.device("cpu"))
    assert greedy_single(torch.full((4, 1, 300), float("-inf")), block, 1, [], num, settings, None, "filtered") is None
