"""The engine's block path against the reference block sampler (``celeris.reference.block.generate_block``):
token for token at temperature 0 (and with seeds), batched, with staggered arrivals and requests at different
blocks; and its cached logits against a full recompute. Float64 models with sharpened weights (``scale``) so
the order in which the engine sums cannot flip a greedy choice."""

from __future__ import annotations

import pytest
import torch

from celeris.config import EngineConfig
from celeris.engine import Engine
from celeris.models.contract import layout_mask
from celeris.models.loader import load_any
from celeris.reference.block import generate_block
from celeris.sampling.block import block_units
from celeris.sampling.params import SamplingParams
from tests.models.conftest_block_formats import write_fast_dllm, write_sdar

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
RULES = [{"decoding": "fixed"}, {"decoding": "threshold", "threshold": 0.3}, {"decoding": "factor", "factor": 1.0},
         {"decoding": "entropy", "entropy_bound": 1.0}, {"decoding": "low_confidence_static"},
         {"decoding": "low_confidence_dynamic", "threshold": 0.3}, {"decoding": "sequential"},
         {"decoding": "fixed", "remasking": "margin"}, {"decoding": "fixed", "repetition_penalty": 1.5, "top_k": 20},
         {"decoding": "threshold", "threshold": 0.5, "temperature": 0.7, "seed": 5, "remasking": "random"}]


@pytest.fixture(scope="module", params=["sdar", "fast_dllm_v2"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    (write_sdar if request.param == "sdar" else write_fast_dllm)(folder, scale=3.0)
    return load_any(folder, dtype=torch.float64)


def run_engine(model, arrivals: list[tuple[int, list[int], SamplingParams]], max_num_seqs: int = 8):
    """Add each (step, prompt, params) at that engine step; run to the end. Returns the requests in order."""
    engine = Engine(model, EngineConfig(max_num_seqs=max_num_seqs))
    requests, step = [], 0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            requests.append(engine.add_request(prompt, params))
        engine.step()
        step += 1
    return requests, engine


def params_for(model, **settings) -> SamplingParams:
    block = model.block_contract.block_size
    base = {"max_tokens": 11, "steps": 2, "block_length": block // 2 if block > 4 else block, "early_exit": False}
    return SamplingParams(**(base | settings))


@pytest.mark.parametrize("rule", RULES, ids=lambda r: "-".join(map(str, r.values())))
def test_engine_equals_reference_for_every_rule(model, rule):
    params = params_for(model, **rule)
    ref = generate_block(model, PROMPTS, params)
    requests, engine = run_engine(model, [(0, p, params) for p in PROMPTS])
    for i, r in enumerate(requests):
        assert r.answer.tolist() == ref.answer_ids[i].tolist()
    assert sum(r.nfe for r in requests) == ref.nfe  # no pass of its own for a finished block's keys/values
    assert engine.block_decoder.num_passes == max(r.nfe for r in requests)


def test_staggered_arrivals_mixed_settings_and_blocks(model):
    """Requests join while others are mid-answer (different blocks, prompt lengths and rules in one pass)."""
    settings = [params_for(model, decoding="low_confidence_dynamic", threshold=0.5),
                params_for(model, decoding="sequential", max_tokens=7),
                params_for(model, decoding="threshold", threshold=0.2, max_tokens=16),
                params_for(model, temperature=0.8, seed=3, top_p=0.9)]
    arrivals = [(0, PROMPTS[0], settings[0]), (2, PROMPTS[1], settings[1]), (3, PROMPTS[2], settings[2]),
                (5, PROMPTS[3], settings[3])]
    requests, _ = run_engine(model, arrivals, max_num_seqs=3)  # the fourth waits for a free slot
    for (_, prompt, params), r in zip(arrivals, requests, strict=True):
        assert r.answer.tolist() == generate_block(model, [prompt], params).answer_ids[0].tolist()


def test_cached_logits_equal_a_full_recompute(model):
    """Every pass of the engine (history read from the KV pool) scores the block as recomputing the canvas does."""
    recorded = []
    original = model.logits

    def record(hidden):
        out = original(hidden)
        recorded.append(out)
        return out

    params = params_for(model, max_tokens=9)
    engine = Engine(model, EngineConfig())
    request = engine.add_request(PROMPTS[1], params)
    contract, shift = model.block_contract, model.logits_shift
    model.logits = record
    try:
        while engine.has_unfinished():
            row = request.state
            canvas = request.canvas.clone()
            first = block_units(len(PROMPTS[1]), 9, contract, params.block_length)[0]  # before the first pass
            a, e, s, t = row.unit if row else first
            engine.step()
            mask = layout_mask(torch.arange(e)[None], e, torch.tensor([a]), torch.tensor([e]), torch.tensor([0]),
                               contract.block_size, contract.attention)
            full = original(model.hidden_states(canvas[None, :e], layout_mask=mask)[:, s - shift : t - shift])
            width = recorded[-1].shape[1]  # 1: a block's first token, scored alone before the block (commit_first)
            assert width == t - s or (width == 1 and contract.commit_first and s == a)
            torch.testing.assert_close(recorded[-1], full[:, :width], atol=1e-9, rtol=1e-9)
    finally:
        del model.logits
    assert len(recorded) == request.nfe > 2


def test_end_ids_stop_the_answer_and_early_exit_saves_passes(model):
    params = params_for(model, max_tokens=16, ignore_eos=True)
    full = generate_block(model, [PROMPTS[0]], params).answer_ids[0].tolist()
    stop_id = full[5]
    stopped = params_for(model, max_tokens=16, early_exit=True)
    engine = Engine(model, EngineConfig(), end_ids=[stop_id])
    request = engine.add_request(PROMPTS[0], stopped)
    streamed = []
    while engine.has_unfinished():
        streamed += [i for o in engine.step() for i in o.new_token_ids]
    assert request.finish_reason == "stop" and streamed == full[: full.index(stop_id)]
    ref = generate_block(model, [PROMPTS[0]], stopped, end_ids=[stop_id])
    assert ref.token_ids[0] == streamed and request.nfe == ref.nfe < generate_block(model, [PROMPTS[0]], params).nfe


@pytest.mark.parametrize("settings", [{"block_length": 4, "decoding": "fixed", "steps": 2},
                                      {"block_length": 2, "decoding": "threshold", "threshold": 0.2},
                                      {"block_length": 4, "decoding": "low_confidence_dynamic", "cache": "delayed"}])
def test_hybrid_block_mode_engine_equals_reference(hybrid, settings):
    params = SamplingParams(max_tokens=10, early_exit=False, **settings)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    ref = generate_block(hybrid, prompts, params)
    requests, engine = run_engine(hybrid, [(0, p, params) for p in prompts])
    assert [r.answer.tolist() for r in requests] == ref.answer_ids.tolist()
    assert engine.block_decoder.num_passes == max(r.nfe for r in requests)


def test_hybrid_next_token_and_block_requests_share_the_engine(hybrid):
    """block_length 1 stays the next-token path (one token per pass), block_length 4 the block path."""
    token = SamplingParams(max_tokens=6, block_length=1, steps=6, cache="delayed", early_exit=False)
    block = SamplingParams(max_tokens=8, block_length=4, steps=4, early_exit=False)
    requests, _ = run_engine(hybrid, [(0, [5, 6, 7], token), (1, [8, 9], block)])
    assert requests[0].nfe == 6
    assert requests[1].answer.tolist() == generate_block(hybrid, [[8, 9]], block).answer_ids[0].tolist()


def test_hybrid_training_layout_equals_block_inference(hybrid):
    """The hybrid objective's clean (+) noisy layout scores each noisy block as the block path does."""
    from celeris.train.objective import hybrid_hidden_states

    g = torch.Generator().manual_seed(4)
    clean = torch.randint(3, 64, (1, 12), generator=g)
    noisy = torch.where(torch.rand(1, 12, generator=g) < 0.5, hybrid.config.mask_token_id, clean)
    hidden = hybrid_hidden_states(hybrid, clean, noisy, 4)[:, 12:]  # the noisy stream
    for b in range(3):
        canvas = torch.cat([clean[:, : 4 * b], noisy[:, 4 * b : 4 * b + 4]], dim=1)
        mask = layout_mask(torch.arange(canvas.shape[1])[None], canvas.shape[1], torch.tensor([4 * b]),
                           torch.tensor([4 * b + 4]), torch.tensor([0]), 4, "causal_history")
        inference = hybrid.hidden_states(canvas, layout_mask=mask)[:, 4 * b :]
        torch.testing.assert_close(hidden[:, 4 * b : 4 * b + 4], inference, atol=1e-6, rtol=1e-6)


def test_finished_and_aborted_requests_leave_no_kv_rows(model):
    """The KV pool gives rows (and, once empty, its storage) back when requests finish or are aborted, without
    waiting for a later step that an idle engine never runs."""
    engine = Engine(model, EngineConfig())
    for prompt in PROMPTS[:2]:
        engine.add_request(prompt, params_for(model, max_tokens=6))
    engine.step()
    assert engine.block_decoder.pool.num_rows == 2
    while engine.has_unfinished():
        engine.step()
    pool = engine.block_decoder.pool
    assert pool.num_rows == 0 and not engine.block_decoder.requests and pool.keys == [] and pool.capacity_length == 0
    kept = engine.add_request(PROMPTS[0], params_for(model, max_tokens=16))
    gone = engine.add_request(PROMPTS[1], params_for(model, max_tokens=16))
    engine.step()
    assert engine.abort(gone.request_id) and pool.owners == [(kept, "cond")]  # freed at once, the other kept
    assert engine.abort(kept.request_id) and pool.num_rows == 0 and not engine.has_unfinished()
