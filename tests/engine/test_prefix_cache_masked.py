"""The engine's one prefix cache (``celeris.engine.kv.PrefixCache``, held by the KV store) serving the masked path's
causal decoding under the ``delayed`` cache: a prompt that shares full blocks with a prompt prefilled before takes
their keys/values from the cache, whichever path prefilled them, its first step computes only the rest, and its
tokens are those of the slow reference and of an engine without the cache. Steps are counted, never timed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from celeris.config import EngineConfig
from celeris.engine import Engine
from celeris.engine.kv import BLOCK_SIZE
from celeris.reference.autoregressive import generate_autoregressive
from celeris.sampling.params import SamplingParams
from tests.engine.test_chunked_prefill import AR, VERIFIED
from tests.engine.test_engine import run_to_end

SHARED = [(5 * i + 2) % 47 + 3 for i in range(2 * BLOCK_SIZE + 7)]  # two full blocks and 7 tokens
FIRST, SECOND = SHARED + [9, 4, 11], SHARED + [13, 8]
SAMPLED = replace(AR, temperature=0.9, top_p=0.9, seed=7, frequency_penalty=0.4)


def decode(engine: Engine, prompt: list[int], params: SamplingParams):
    request = engine.add_request(prompt, params)
    run_to_end(engine, max_steps=1000)
    return request


def reference(model, prompt: list[int], params: SamplingParams) -> list[int]:
    return generate_autoregressive(model, [prompt], params, use_cache=False).token_ids[0]


def test_a_shared_prefix_comes_from_the_cache_and_the_tokens_are_the_references(hybrid):
    engine = Engine(hybrid, EngineConfig(max_num_seqs=2, max_model_len=96))
    first, second = decode(engine, FIRST, AR), decode(engine, SECOND, AR)
    assert (first.num_cached, second.num_cached) == (0, 2 * BLOCK_SIZE)
    stats = engine.stats()
    assert stats.prefix_cache_queries == len(FIRST) + len(SECOND) and stats.prefix_cache_hits == 2 * BLOCK_SIZE
    assert second.nfe == first.nfe  # the cached prefix costs no pass of its own: one window pass took the rest
    eos = hybrid.config.eos_token_id
    for request, prompt in ((first, FIRST), (second, SECOND)):
        assert request.final_prefix(eos) == reference(hybrid, prompt, AR)


@pytest.mark.parametrize("params", [AR, SAMPLED], ids=["greedy", "sampled-penalized"])
def test_the_cache_changes_no_token(hybrid, params):
    """The same prompts through an engine with the cache and one without: the same tokens, seeded sampling and a
    frequency penalty included (the cached keys/values are the ones the prompt's own prefill would compute)."""
    answers = {}
    for caching in (True, False):
        engine = Engine(hybrid, EngineConfig(max_num_seqs=2, max_model_len=96, enable_prefix_caching=caching))
        answers[caching] = [decode(engine, p, params) for p in (FIRST, SECOND, SECOND)]
    assert [r.num_cached for r in answers[True]] == [0, 2 * BLOCK_SIZE, 2 * BLOCK_SIZE]
    assert [r.num_cached for r in answers[False]] == [0, 0, 0]
    assert [r.answer.tolist() for r in answers[True]] == [r.answer.tolist() for r in answers[False]]


def test_one_cache_serves_both_paths(hybrid):
    """A prompt prefilled by verified decoding serves a next-token request, and one prefilled by next-token decoding
    serves a verified one: the engine has one prefix cache."""
    engine = Engine(hybrid, EngineConfig(max_num_seqs=2, max_model_len=96))
    decode(engine, FIRST, VERIFIED)
    masked = decode(engine, SECOND, AR)
    assert masked.num_cached == 2 * BLOCK_SIZE
    assert engine.stats().prefix_cache_hits == 2 * BLOCK_SIZE
    engine.reset_prefix_cache()
    decode(engine, FIRST, AR)
    verified = decode(engine, SECOND, VERIFIED)
    assert engine.stats().prefix_cache_hits == 4 * BLOCK_SIZE  # the verified prefill read the masked one's blocks
    eos = hybrid.config.eos_token_id
    assert masked.final_prefix(eos) == verified.final_prefix(eos) == reference(hybrid, SECOND, AR)


def test_a_chunked_prefill_goes_on_after_the_cached_prefix(hybrid):
    """With a budget of 12 columns, the second prompt's prefill starts after its cached 32 tokens: one chunk for
    the 7 + 2 left (not chunks from its start), and the tokens stay the reference's."""
    engine = Engine(hybrid, EngineConfig(max_num_seqs=2, max_model_len=96, max_num_batched_tokens=12))
    first, second = decode(engine, FIRST, AR), decode(engine, SECOND, AR)
    assert first.prefill_target and second.prefill_target  # both too long for one step's budget
    assert second.num_cached == 2 * BLOCK_SIZE
    chunks = [r.nfe - r.num_steps for r in (first, second)]  # passes that committed nothing: the prefill's chunks
    assert chunks[1] == 1 < chunks[0]
    eos = hybrid.config.eos_token_id
    assert second.final_prefix(eos) == reference(hybrid, SECOND, AR)


def test_an_engine_without_prefix_caching_looks_nothing_up(hybrid):
    engine = Engine(hybrid, EngineConfig(max_num_seqs=2, max_model_len=96, enable_prefix_caching=False))
    decode(engine, FIRST, AR)
    assert decode(engine, FIRST, AR).num_cached == 0
    assert engine.runner.kv.prefix_cache is None and engine.stats().prefix_cache_queries == 0


def test_a_hit_beside_running_rows_and_an_abort_after_a_hit(hybrid):
    """A prompt that hits joins while another request is mid-answer (its row copied beside a live row, the two
    stepped together): both answers are the references'. A request aborted right after its hit leaves the pool and
    the cache usable: the next hit on the same blocks still gives the reference's tokens."""
    engine = Engine(hybrid, EngineConfig(max_num_seqs=3, max_model_len=96))
    decode(engine, FIRST, AR)
    other = engine.add_request([7, 3, 9, 21], AR)
    engine.step()
    engine.step()  # ``other`` has its row and a few tokens
    joined = engine.add_request(SECOND, AR)
    run_to_end(engine)
    assert joined.num_cached == 2 * BLOCK_SIZE
    eos = hybrid.config.eos_token_id
    assert other.final_prefix(eos) == reference(hybrid, [7, 3, 9, 21], AR)
    assert joined.final_prefix(eos) == reference(hybrid, SECOND, AR)
    aborted = engine.add_request(SECOND, AR)
    engine.step()  # its first step: the hit copied in, one window pass
    assert aborted.num_cached == 2 * BLOCK_SIZE and engine.abort(aborted.request_id)
    after = decode(engine, FIRST, AR)
    assert after.num_cached == 2 * BLOCK_SIZE and not engine.has_unfinished()
    assert after.final_prefix(eos) == reference(hybrid, FIRST, AR)
