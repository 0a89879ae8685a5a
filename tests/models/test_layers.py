"""The shared layers of the LLaDA and Dream formats: name tables, the samplers, the KV-cache interface.

A window pass after a full pass with unchanged tokens must give the full
pass's logits (also for Dream, whose logits at position i come from the hidden
state at i-1, so its window starts one position earlier inside the model), and
the samplers' ``prefix`` / ``dual`` caches must run on both formats.
"""

from __future__ import annotations

import pytest
import torch

from celeris.config import EngineConfig
from celeris.engine import Engine
from celeris.models import celeris as celeris_module
from celeris.models import layers
from celeris.models.loader import FORMATS, load_any
from celeris.params import SamplingParams
from celeris.sampling.cache import cache_window
from celeris.sampling.generate import generate
from tests.models.conftest_block_formats import write_fast_dllm, write_llada2, write_sdar
from tests.models.conftest_formats import padded_batch, write_dream, write_llada

WRITERS = {"llada": write_llada, "dream": write_dream}
VARIANTS = {  # config overrides that change the module layout (tied head, biases, one K/V head)
    "llada": {"weight_tying": True, "include_qkv_bias": True, "n_kv_heads": 1},
    "dream": {"tie_word_embeddings": True, "num_key_value_heads": 1},
    "sdar": {"tie_word_embeddings": True, "num_key_value_heads": 1, "head_dim": 4},
    "fast_dllm_v2": {"tie_word_embeddings": True, "num_key_value_heads": 1},
    "llada2": {"use_qkv_bias": True, "use_bias": True, "num_key_value_heads": 1, "num_shared_experts": None},
}
# block-diffusion formats too
ALL_WRITERS = WRITERS | {"sdar": write_sdar, "fast_dllm_v2": write_fast_dllm, "llada2": write_llada2}


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


@pytest.mark.parametrize("name", sorted(ALL_WRITERS))
@pytest.mark.parametrize("variant", [False, True])
def test_checkpoint_keys_name_every_module_parameter(name, variant, tmp_path):
    """The rename table's targets are exactly the model's state_dict names (none missing, none left over)."""
    fmt = FORMATS[name]
    ALL_WRITERS[name](tmp_path, num_shards=1, **(VARIANTS[name] if variant else {}))
    model = load_any(tmp_path)
    num_layers = len(model.layers)
    experts = range(getattr(model.config, "num_experts", 1))  # "{e}": an expert index (mixture of experts)
    targets = {t.replace("{i}", str(i)).replace("{e}", str(e)).split("[")[0] for t in fmt.checkpoint_keys.values()
               for i in range(num_layers) for e in experts}
    assert set(model.state_dict()) <= targets
    assert model.supports_kv_cache


@pytest.mark.parametrize("overrides", [{"decoding": "fixed"}, {"decoding": "threshold", "threshold": 0.5},
                                       {"cfg_scale": 1.0}])
def test_sampler_runs(model, overrides):
    params = SamplingParams(max_tokens=8, steps=8, block_length=4, early_exit=False, seed=0, **overrides)
    out = generate(model, [[5, 6, 7, 8], [9, 10]], params)
    assert out.answer_ids.shape == (2, 8)
    assert not (out.answer_ids == model.config.mask_token_id).any()
    if overrides.get("decoding", "fixed") == "fixed":
        assert out.nfe == 8 * (2 if overrides.get("cfg_scale") else 1)


def test_batched_equals_unbatched(model):
    params = SamplingParams(max_tokens=8, steps=8, block_length=4, early_exit=False)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    both = generate(model, prompts, params).answer_ids
    for i, p in enumerate(prompts):
        assert torch.equal(generate(model, [p], params).answer_ids[0], both[i])


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
            assert (filled - full[:, span]).abs().max() < 1e-6
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


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_generate_with_cache_runs_and_one_step_per_block_equals_no_cache(model, cache):
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    mask_id = model.config.mask_token_id
    params = SamplingParams(max_tokens=12, steps=12, block_length=4, early_exit=False, cache=cache, seed=0)
    out = generate(model, prompts, params)  # several steps per block: window passes read the cache
    assert out.answer_ids.shape == (2, 12) and not (out.answer_ids == mask_id).any()
    assert out.nfe == 12
    guided = SamplingParams(max_tokens=8, steps=8, block_length=4, early_exit=False, cache=cache, cfg_scale=1.0)
    assert not (generate(model, prompts, guided).answer_ids == mask_id).any()
    one = SamplingParams(max_tokens=12, steps=3, block_length=4, early_exit=False, cache=cache)
    none = SamplingParams(max_tokens=12, steps=3, block_length=4, early_exit=False)
    assert torch.equal(generate(model, prompts, one).answer_ids, generate(model, prompts, none).answer_ids)


@pytest.mark.parametrize("cache", ["prefix", "dual", "delayed", "dual_delayed"])
def test_engine_with_cache_matches_reference_sampler(model, cache):
    """The engine's block-aligned padded window passes give the reference sampler's tokens on both formats."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    params = SamplingParams(max_tokens=12, steps=12, block_length=4, early_exit=False, cache=cache)
    reference = generate(model, prompts, params)
    engine = Engine(model, EngineConfig(max_num_seqs=4))
    requests = [engine.add_request(p, params) for p in prompts]
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        engine.step()
    for i, r in enumerate(requests):
        assert torch.equal(r.answer, reference.answer_ids[i]), f"row {i}"


@pytest.mark.parametrize("cache, suffix_window", [("prefix", 0), ("dual_delayed", 0), ("dual_delayed", 3)])
def test_engine_out_of_phase_requests_match_reference_sampler(model, cache, suffix_window):
    """Requests out of phase (two join one step late): the rows recomputing the masked suffix run their window
    pass apart from the others (``ModelRunner.num_split_passes``), and each request still gets the reference
    sampler's tokens for its prompt alone, on both formats (Dream scores each column from the one before it)."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    params = SamplingParams(max_tokens=12, steps=12, block_length=2, early_exit=False, cache=cache,
                            suffix_window=suffix_window)
    alone = [generate(model, [p], params).answer_ids[0] for p in prompts]
    engine = Engine(model, EngineConfig(max_num_seqs=4))
    requests = [engine.add_request(prompts[0], params)]
    engine.step()
    requests += [engine.add_request(p, params) for p in prompts[1:]]
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        engine.step()
    assert engine.runner.num_split_passes > 0
    for r, expected in zip(requests, alone, strict=True):
        assert torch.equal(r.answer, expected)


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
