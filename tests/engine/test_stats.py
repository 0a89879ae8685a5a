"""``Engine.stats()``: one KV figure over every store of the engine, and the verified path's counters, read without
reaching into the paths (the server's metrics and the bench read only this)."""

from __future__ import annotations

from celeris.config import EngineConfig
from celeris.engine.engine import Engine
from celeris.params import SamplingParams
from celeris.sampling.verified import MAX_DRAFTS


def store_bytes(model, rows: int, tokens: int) -> int:
    """Keys and values of ``rows`` x ``tokens`` positions in every layer, float64 (the model's dtype)."""
    return 2 * len(model.layers) * rows * model.arch.num_kv_heads * tokens * model.arch.head_dim * 8


def test_one_kv_figure_counts_every_store_and_drops_as_requests_finish(hybrid):
    rows, max_len = 3, 48
    engine = Engine(hybrid, EngineConfig(max_num_seqs=rows, max_model_len=max_len))
    assert engine.stats().kv_bytes == 0  # nothing is allocated before a request needs it
    token = SamplingParams(max_tokens=6, block_length=1, steps=6, cache="delayed", early_exit=False)  # masked path
    block = SamplingParams(max_tokens=8, block_length=4, steps=4, early_exit=False)  # block path
    verified = SamplingParams(max_tokens=8, steps=8, block_length=1, decoding="verified", early_exit=False)
    for prompt, params in (([5, 6, 7], token), ([8, 9], block), ([10, 11, 12], verified)):
        engine.add_request(prompt, params)
    engine.step()
    stats = engine.stats()
    verified_pool = store_bytes(hybrid, rows, max_len + 2 * MAX_DRAFTS + 2)  # preallocated for max_num_seqs rows
    one_block_of_rows = store_bytes(hybrid, 8, 64)  # a growing pool reserves 8 rows x 64 columns at a time
    assert stats.kv_bytes == verified_pool + 2 * one_block_of_rows  # the masked path's pool and the block path's
    assert stats.num_running == 3 and stats.num_waiting == 0 and stats.num_steps == 1
    while engine.has_unfinished():
        engine.step()
    done = engine.stats()
    assert done.kv_bytes == verified_pool  # the growing pools gave their memory back
    assert done.num_running == 0 and done.num_steps > 1
    assert len(done.drafted) == len(done.accepted) >= 1 and sum(done.drafted) >= sum(done.accepted)
    assert done.prefix_cache_queries == 3 and done.prefix_cache_hits == 0  # one prompt of 3 tokens, no block reused
