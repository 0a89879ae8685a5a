"""The engine's one KV store (``celeris.engine.kv.KVStore``) and ``Engine.stats()``: every mode takes its rows
from one allocation sized from ``EngineConfig`` (``max_num_seqs`` rows of ``max_model_len`` + ``ROW_SLACK``
columns, the K/V heads) and gives them back; ``stats()`` reports that one figure and the verified path's counters,
read without reaching into the paths (the server's metrics and the bench read only this)."""

from __future__ import annotations

import copy

import pytest
import torch

from celeris.config import EngineConfig
from celeris.engine.engine import Engine
from celeris.engine.kv import ROW_SLACK
from celeris.sampling.drafter import DFlashProposer, attach
from celeris.sampling.params import SamplingParams
from tests.conftest import tiny_model
from tests.sampling.test_drafter import drafter_for

SETTINGS = {
    "masked": SamplingParams(max_tokens=6, block_length=1, steps=6, cache="delayed", early_exit=False),
    "block": SamplingParams(max_tokens=8, block_length=4, steps=4, early_exit=False),
    "verified": SamplingParams(max_tokens=8, steps=8, block_length=1, decoding="verified", early_exit=False),
}
PROMPTS = {"masked": [5, 6, 7], "block": [8, 9], "verified": [10, 11, 12]}


def store_bytes(model, rows: int, tokens: int) -> int:
    """Keys and values of ``rows`` x ``tokens`` positions in every layer, float64 (the model's dtype)."""
    return 2 * len(model.layers) * rows * model.arch.num_kv_heads * tokens * model.arch.head_dim * 8


def alone(model, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = Engine(model, EngineConfig(max_num_seqs=2))  # two rows: room for a CFG request's
    request = engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return request.answer.tolist()


def test_one_store_sized_for_exactly_three_modes_holds_them_at_once(hybrid):
    rows, max_len = 3, 48  # one row each: the masked request (delayed cache), the block one, the verified one
    engine = Engine(hybrid, EngineConfig(max_num_seqs=rows, max_model_len=max_len))
    assert engine.stats().kv_bytes == 0  # nothing is allocated before a request needs it
    requests = {mode: engine.add_request(PROMPTS[mode], params) for mode, params in SETTINGS.items()}
    engine.step()
    store = engine.runner.kv
    stats = engine.stats()
    assert stats.kv_bytes == store.nbytes == store_bytes(hybrid, rows, max_len + ROW_SLACK)  # one allocation
    assert store.num_free_rows == 0 and [s.num_rows for s in store.segments] == [1, 1, 1]  # full, one row each
    pools = {"masked": engine.runner.pool.segment, "block": engine.block_decoder.pool.segment,
             "verified": engine.drafter.segment}
    assert all(segment.store is store for segment in pools.values())  # every mode takes from the one store
    assert stats.num_running == 3 and stats.num_waiting == 0 and stats.num_steps == 1
    while engine.has_unfinished():
        engine.step()
    for mode, r in requests.items():
        assert r.answer.tolist() == alone(hybrid, PROMPTS[mode], SETTINGS[mode]), mode
    done = engine.stats()
    assert done.kv_bytes == stats.kv_bytes and store.num_free_rows == rows  # every row given back, kept allocated
    assert done.num_running == 0 and done.num_steps > 1
    assert len(done.drafted) == len(done.accepted) >= 1 and sum(done.drafted) >= sum(done.accepted)
    # the engine's one prefix cache: the verified prompt and the masked one (causal, delayed cache) looked up, 3
    # tokens each, no block reused; the block request's prefill (its own attention) does not use it
    assert done.prefix_cache_queries == 6 and done.prefix_cache_hits == 0


def drafter_bytes(drafter, rows: int, tokens: int) -> int:
    """The drafter's keys and values for ``rows`` x ``tokens`` positions in each of its layers, float64."""
    cfg = drafter.config
    return 2 * cfg.num_hidden_layers * rows * cfg.num_key_value_heads * tokens * cfg.head_dim * 8


@pytest.fixture
def with_drafter(hybrid):
    """A copy of the hybrid with a 2-layer DFlash drafter attached whose keys/values are shaped unlike the target's
    (1 K/V head of 16 dims against 4 of 8), float64."""
    model = copy.deepcopy(hybrid)
    drafter = drafter_for(model, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16).double()
    attach(model, DFlashProposer(drafter, model))
    return model, drafter


def test_the_store_holds_the_drafters_layers_beside_the_targets(with_drafter):
    """A store of exactly 3 rows serves a masked, a block and a verified request with a DFlash drafter at once:
    the verified row's drafter keys/values are in the store (kv_bytes counts the drafter's layers of every row),
    each request gets the tokens it gets alone, and a masked request arriving later packs the segments, moving the
    verified row with its drafter context mid-answer."""
    model, drafter = with_drafter
    proposer, drafts = model.__dict__["_celeris_proposer"], []
    propose = proposer.propose_draft_vocab  # what the DFlash proposer calls

    def spy(*args: object) -> tuple[torch.Tensor, torch.Tensor | None]:  # every drafter call's argmax drafts
        logits, ids = propose(*args)
        top = logits.argmax(-1)
        drafts.append((top if ids is None else ids[top]).tolist())
        return logits, ids

    proposer.propose_draft_vocab = spy
    rows, max_len = 3, 48
    verified = SamplingParams(max_tokens=16, steps=16, block_length=1, decoding="verified", early_exit=False,
                              draft_source="dflash")
    settings = {"block": SETTINGS["block"], "verified": verified, "masked": SETTINGS["masked"]}
    engine = Engine(model, EngineConfig(max_num_seqs=rows, max_model_len=max_len))
    requests = {mode: engine.add_request(PROMPTS[mode], settings[mode]) for mode in ("block", "verified")}
    engine.step()
    store = engine.runner.kv
    assert store.drafter is drafter and len(store.draft_keys) == drafter.config.num_hidden_layers
    expected = store_bytes(model, rows, max_len + ROW_SLACK) + drafter_bytes(drafter, rows, max_len + ROW_SLACK)
    assert engine.stats().kv_bytes == store.nbytes == expected
    verified_segment = engine.drafter.segment
    start = verified_segment.start
    requests["masked"] = engine.add_request(PROMPTS["masked"], settings["masked"])
    engine.step()  # the masked segment (the first) takes a row: the block and verified segments move right
    assert store.num_free_rows == 0 and verified_segment.start == start + 1
    row = requests["verified"].state
    held = row.draft_state.cache.filled  # its context's keys are in the store's drafter layers, at its row
    assert held > len(PROMPTS["verified"]) and verified_segment.draft_keys[0][0, :, :held].abs().min() > 0
    while engine.has_unfinished():
        engine.step()
    assert requests["verified"].drafter_passes == len(drafts) > 1
    together, drafts[:] = list(drafts), []
    for mode, r in requests.items():
        assert r.answer.tolist() == alone(model, PROMPTS[mode], settings[mode]), mode
    assert together == drafts  # the drafter saw the same context: its keys/values moved with the row
    assert engine.stats().kv_bytes == expected and store.num_free_rows == rows


def test_the_scheduler_admits_no_more_rows_than_the_store_has():
    """A CFG request with a cache takes two rows (its unconditional row too): beside it, a store of three rows
    holds one more cached request, and the third waits for a row; every request still gets its tokens alone."""
    model = tiny_model()  # full attention: CFG applies
    cfg = SamplingParams(max_tokens=8, block_length=4, steps=8, cache="dual", cfg_scale=1.0, early_exit=False)
    plain = SamplingParams(max_tokens=8, block_length=4, steps=8, cache="dual", early_exit=False)
    prompts, settings = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [cfg, plain, plain]
    engine = Engine(model, EngineConfig(max_num_seqs=3))
    requests = [engine.add_request(p, params) for p, params in zip(prompts, settings, strict=True)]
    engine.step()
    assert engine.scheduler.running == requests[:2] and engine.runner.kv.num_free_rows == 0
    assert engine.kv_rows(engine.scheduler.running) == 3 and requests[2].num_steps == 0  # it waits for a row
    while engine.has_unfinished():
        engine.step()
    for prompt, params, r in zip(prompts, settings, requests, strict=True):
        assert r.answer.tolist() == alone(model, prompt, params)
    with pytest.raises(ValueError, match="^cfg_scale with cache='dual' needs 2 rows of the KV store, which has 1"):
        Engine(model, EngineConfig(max_num_seqs=1)).add_request([5, 6], cfg)


def test_a_request_that_takes_rows_must_fit_max_model_len(hybrid):
    from celeris.sampling.modes import ContextLengthError

    engine = Engine(hybrid, EngineConfig(max_model_len=16))
    with pytest.raises(ContextLengthError, match="context window is 16 tokens"):
        engine.add_request([5] * 12, SETTINGS["masked"])
