"""Automatic prefix caching (celeris.engine.kv) in verified decoding: which prefix a prompt reuses
(whole blocks, never its last token), LRU eviction, and answers token-identical to decoding without the cache
(greedy at temperature 0, the same sampled tokens at temperature > 0), row by row and through the engine."""

from __future__ import annotations

import pytest
import torch

from celeris.config import EngineConfig
from celeris.engine.engine import Engine
from celeris.engine.kv import BLOCK_SIZE, PrefixCache
from celeris.engine.verified import VerifiedDecoder
from celeris.reference.autoregressive import generate_autoregressive
from celeris.sampling.params import SamplingParams
from tests.conftest import tiny_model

BASE = torch.randint(1, 60, (40,), generator=torch.Generator().manual_seed(0)).tolist()
# (prompt, tokens it reuses after the prompts before it): a miss, a prefix of the first (a partial block past a
# full one), a full block then new tokens, an exact block multiple (its last block holds its last token, so one
# block less), a prompt shorter than a block, one that extends the first, the same prompt again, a new prompt
CASES = [(BASE[:33], 0), (BASE[:20], 16), (BASE[:16] + [7, 8, 9], 16), (BASE[:32], 16), (BASE[:5], 0),
         (BASE[:40], 32), (BASE[:40], 32), ([3] * 17, 0)]


@pytest.fixture(scope="module")
def hybrid():
    return tiny_model(seed=3, is_causal=True, draft_block_size=3)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    return generate_autoregressive(model, [prompt], SamplingParams(max_tokens=n, steps=n)).token_ids[0]


def one_by_one(model, prompts: list[list[int]], params: SamplingParams, cache_tokens: int,
               decoder_rows: int = 2) -> tuple[list[list[int]], list[int], VerifiedDecoder]:
    """Each prompt decoded alone in turn by one decoder: (answers, cached prompt tokens per row, the decoder)."""
    dec = VerifiedDecoder(model, decoder_rows, 64, prefix_cache_tokens=cache_tokens)
    answers, cached = [], []
    for prompt in prompts:
        row = dec.add(prompt, params)
        cached.append(row.num_cached)
        while not row.finished:
            dec.step()
        dec.remove(row)
        answers.append(row.answer)
    return answers, cached, dec


def test_lookup_reuses_whole_blocks_never_the_last_token():
    kv = torch.arange(40.0).expand(4, 2, 40)[..., None]  # (2 * layers, H, T, D): column c holds c
    cache = PrefixCache(1024)
    for prompt, want in CASES:
        n, got = cache.lookup(prompt)
        assert n == want and n % BLOCK_SIZE == 0 and n < len(prompt)
        if n:
            assert torch.equal(got, kv[:, :, :n])  # the blocks are in column order
        cache.insert(prompt, kv[:, :, n:], n)
    assert cache.query_tokens == sum(len(p) for p, _ in CASES) and cache.hit_tokens == sum(w for _, w in CASES)
    assert cache.lookup([3] * 16) == (0, None)  # its only block ends at its last token
    with pytest.raises(ValueError, match="at least one block"):
        PrefixCache(BLOCK_SIZE - 1)


def test_eviction_drops_the_least_recently_used_blocks_deepest_first():
    kv = torch.zeros(2, 1, 48, 1)
    cache = PrefixCache(3 * BLOCK_SIZE)
    a, b = BASE[:33], [9] * 33
    cache.insert(a, kv)  # blocks a1, a2
    cache.insert(b, kv)  # b1, b2: a2 (a's deepest, least recently used) goes first
    assert len(cache.blocks) == 3 and cache.lookup(a + [1])[0] == BLOCK_SIZE and cache.lookup(b + [1])[0] == 32
    cache.insert(a[:16] + [5] * 17, kv)  # a1 (just used) stays, b2 (least recently used) goes
    assert len(cache.blocks) == 3 and cache.lookup(b + [1])[0] == BLOCK_SIZE
    assert cache.lookup(a[:16] + [5] * 18)[0] == 32


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cached_prefixes_give_the_same_answers(hybrid, temperature):
    """At temperature 0 the answers are greedy's; at 0.8 (seeded) the sampled tokens equal those without the
    cache: on this CPU the reused keys/values are bitwise those a full prefill computes."""
    prompts = [p for p, _ in CASES]
    params = SamplingParams(max_tokens=10, steps=10, early_exit=False, temperature=temperature, seed=7)
    with_cache, cached, dec = one_by_one(hybrid, prompts, params, 1024)
    without, none, _ = one_by_one(hybrid, prompts, params, 0)
    assert cached == [w for _, w in CASES] and none == [0] * len(CASES)
    assert with_cache == without
    if temperature == 0:
        assert with_cache == [greedy(hybrid, p, 10) for p in prompts]
    assert dec.prefix_cache.hit_tokens == sum(cached)


def test_a_small_cache_evicts_and_keeps_answers(hybrid):
    """A cache of one block evicts on almost every new prompt: still greedy answers, fewer hits."""
    prompts = [p for p, _ in CASES] + [BASE[:33]]
    params = SamplingParams(max_tokens=8, steps=8, early_exit=False)
    answers, cached, dec = one_by_one(hybrid, prompts, params, BLOCK_SIZE)
    assert answers == [greedy(hybrid, p, 8) for p in prompts]
    assert len(dec.prefix_cache.blocks) == 1 and cached[-1] == 0  # [3] * 17 pushed BASE's blocks out
    assert 0 < sum(cached) < sum(w for _, w in CASES)


def test_engine_with_staggered_arrivals_reuses_prefixes(hybrid):
    """Requests sharing prefixes arrive while others decode: each answer equals greedy, the later ones skip
    their cached prefix, and ``enable_prefix_caching=False`` caches nothing."""
    prompts = [BASE[:33], BASE[:35], BASE[:18] + [4], BASE[:33], [6, 7, 8]]
    arrivals = {0: [0], 1: [1], 3: [2, 3], 4: [4]}  # step -> requests arriving then
    params = SamplingParams(max_tokens=9, steps=9, block_length=1, decoding="verified", early_exit=False)
    for enabled in (True, False):
        engine = Engine(hybrid, EngineConfig(max_num_seqs=3, enable_prefix_caching=enabled))
        requests, step = [], 0
        while step < 100 and (step <= 4 or engine.has_unfinished()):
            requests += [(i, engine.add_request(prompts[i], params)) for i in arrivals.get(step, [])]
            engine.step()
            step += 1
        for i, request in requests:
            assert request.final_prefix(hybrid.config.eos_token_id) == greedy(hybrid, prompts[i], 9)
        cache = engine.drafter.prefix_cache
        assert (cache.hit_tokens == 32 + 16 + 32) if enabled else cache is None
