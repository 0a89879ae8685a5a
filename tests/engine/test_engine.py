"""Engine (``celeris.engine.engine``): continuous batching gives the reference sampler's tokens, on the Celeris
model, its causal twin and the LLaDA / Dream formats; abort; streaming; what a model cannot decode is refused."""

from __future__ import annotations

import pytest
import torch

from celeris.config import EngineConfig
from celeris.engine import Engine, RequestStatus
from celeris.models.loader import load_any
from celeris.reference.masked import generate
from celeris.sampling.params import SamplingParams
from tests.conftest import tiny_model
from tests.models.conftest_formats import write_dream, write_llada

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]


def run_to_end(engine: Engine, max_steps: int = 10_000) -> None:
    """Step ``engine`` until no request is unfinished; AssertionError after ``max_steps`` steps (a hang)."""
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=20, steps=10, block_length=8, early_exit=False),
    SamplingParams(max_tokens=20, steps=20, block_length=8, cfg_scale=1.5, early_exit=False),
    SamplingParams(max_tokens=20, steps=20, block_length=8, decoding="threshold", threshold=0.3, early_exit=False),
    SamplingParams(max_tokens=20, steps=20, block_length=8, temperature=1.0, seed=7, remasking="random"),
    SamplingParams(max_tokens=20, steps=20, block_length=8, cache="prefix", early_exit=False),
    SamplingParams(max_tokens=20, steps=20, block_length=8, cache="dual", cfg_scale=1.0, early_exit=False),
    SamplingParams(max_tokens=20, steps=20, block_length=4, cache="delayed", early_exit=False),
    SamplingParams(max_tokens=20, steps=20, block_length=4, repetition_penalty=1.5, early_exit=False),
    SamplingParams(max_tokens=20, steps=20, block_length=4, frequency_penalty=1.5, presence_penalty=0.5,
                   early_exit=False),
    SamplingParams(max_tokens=20, steps=20, block_length=8, cache="delayed", decoding="threshold", threshold=0.3,
                   early_exit=False),
    SamplingParams(max_tokens=20, steps=20, block_length=8, cache="prefix", decoding="threshold", threshold=0.3,
                   early_exit=False),
    SamplingParams(max_tokens=20, steps=20, block_length=4, cache="delayed", cfg_scale=1.0, early_exit=False),
    SamplingParams(max_tokens=20, steps=10, block_length=4, cache="delayed", cache_refresh=2, early_exit=False),
    SamplingParams(max_tokens=20, steps=10, block_length=4, cache="dual_delayed", early_exit=False),
    SamplingParams(max_tokens=18, steps=18, block_length=4, cache="dual_delayed", cfg_scale=1.0, early_exit=False),
    SamplingParams(max_tokens=20, steps=20, block_length=8, cache="dual_delayed", decoding="threshold", threshold=0.3,
                   early_exit=False),
    SamplingParams(max_tokens=20, steps=10, block_length=4, cache="dual_delayed", cache_refresh=2, early_exit=False),
    SamplingParams(max_tokens=20, steps=20, block_length=8, suffix_window=2, early_exit=False),
    SamplingParams(max_tokens=20, steps=20, block_length=4, cache="dual_delayed", suffix_window=3, early_exit=False),
    SamplingParams(max_tokens=20, steps=20, block_length=4, cache="prefix", suffix_window=2, cfg_scale=1.0,
                   early_exit=False),
    SamplingParams(max_tokens=20, steps=20, block_length=4, cache="dual", suffix_window=1, early_exit=False),
    SamplingParams(max_tokens=20, steps=10, block_length=8, remasking="margin", top_k=5, early_exit=False),
    SamplingParams(max_tokens=20, steps=10, block_length=4, remasking="entropy", cache="dual_delayed",
                   early_exit=False),
    SamplingParams(max_tokens=20, steps=20, block_length=8, temperature=1.0, seed=7, remasking="margin", top_k=3),
])
def test_engine_matches_reference_sampler(params):
    model = tiny_model()
    reference = generate(model, PROMPTS, params)
    engine = Engine(model, EngineConfig(max_num_seqs=8))
    requests = [engine.add_request(p, params) for p in PROMPTS]
    run_to_end(engine)
    eos = model.config.eos_token_id
    for i, r in enumerate(requests):
        assert r.final_prefix(eos) == reference.token_ids[i], f"row {i}"
        if not params.early_exit:  # with early exit the engine stops each request on its own
            assert torch.equal(r.answer, reference.answer_ids[i]), f"row {i}"
        if not params.early_exit and params.decoding == "fixed":
            assert r.nfe == reference.nfe
        # the reference steps a batch until its slowest row is done; the engine steps each request alone,
        # exactly as the reference sampler steps that prompt alone
        assert r.nfe <= reference.nfe and r.nfe == generate(model, [PROMPTS[i]], params).nfe, f"row {i}"


def test_request_joining_mid_flight_gets_the_same_tokens_as_alone():
    """Continuous batching: a request admitted while others are mid-block is unaffected by them."""
    model = tiny_model()
    params = SamplingParams(max_tokens=16, steps=16, block_length=8, early_exit=False)
    alone = [generate(model, [p], params).answer_ids[0] for p in PROMPTS]
    engine = Engine(model, EngineConfig(max_num_seqs=8))
    first = engine.add_request(PROMPTS[0], params)
    for _ in range(5):
        engine.step()
    late = [engine.add_request(p, params) for p in PROMPTS[1:]]
    run_to_end(engine)
    for r, expected in zip([first, *late], alone, strict=True):
        assert torch.equal(r.answer, expected)


def test_aborted_request_takes_no_more_steps():
    engine = Engine(tiny_model(), EngineConfig(max_num_seqs=4))
    params = SamplingParams(max_tokens=16, steps=16, block_length=8, early_exit=False)
    keep = engine.add_request(PROMPTS[0], params, request_id="keep")
    gone = engine.add_request(PROMPTS[1], params, request_id="gone")
    engine.step()
    engine.step()
    assert engine.abort("gone") and gone.status is RequestStatus.ABORTED
    steps_at_abort = gone.num_steps
    outputs = engine.step()
    assert [o.request.request_id for o in outputs] == ["keep"]
    run_to_end(engine)
    assert gone.num_steps == steps_at_abort and keep.num_steps == 16 and gone.finish_reason == "abort"
    assert not engine.abort("unknown")


def test_streamed_tokens_are_the_final_prefix():
    """new_token_ids over all steps concatenate to the answer cut at end-of-text."""
    model = tiny_model()
    params = SamplingParams(max_tokens=16, steps=16, block_length=4, early_exit=False)
    engine = Engine(model, EngineConfig())
    request = engine.add_request(PROMPTS[0], params)
    streamed: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            streamed += out.new_token_ids
    assert streamed == request.final_prefix(model.config.eos_token_id)
    assert request.first_token_time is not None and request.finish_time >= request.first_token_time


def test_cache_needs_model_support():
    model = tiny_model()
    model.supports_kv_cache = False
    engine = Engine(model, EngineConfig())
    with pytest.raises(ValueError, match="cache='dual' is not supported"):
        engine.add_request([5, 6], SamplingParams(cache="dual"))


@pytest.mark.parametrize(("cache", "refresh"), [("none", 0), ("delayed", 0), ("delayed", 3)])
def test_engine_decodes_a_causal_model_token_by_token(cache, refresh):
    """The AR twin through the engine (blocks of one token, shifted logits) is exactly greedy next-token decoding:
    the same tokens as the autoregressive decoder recomputing everything, for each cache it takes, joined mid-flight."""
    from celeris.reference.autoregressive import generate_autoregressive

    model = tiny_model(is_causal=True)
    params = SamplingParams(max_tokens=12, steps=12, block_length=1, cache=cache,
                            cache_refresh=refresh if cache == "delayed" else None, early_exit=False)
    want = generate_autoregressive(model, PROMPTS, SamplingParams(max_tokens=12, early_exit=False),
                                   use_cache=False).answer_ids
    assert len({tuple(row.tolist()) for row in want}) == len(PROMPTS)  # the rows differ: a real check
    assert torch.equal(generate(model, PROMPTS, params).answer_ids, want)  # the reference sampler too
    engine = Engine(model, EngineConfig(max_num_seqs=8))
    first = engine.add_request(PROMPTS[0], params)
    for _ in range(3):
        engine.step()
    requests = [first] + [engine.add_request(p, params) for p in PROMPTS[1:]]
    run_to_end(engine)
    for i, r in enumerate(requests):
        assert torch.equal(r.answer, want[i]), f"row {i}"
        assert r.nfe == 12


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 3.0}, {"frequency_penalty": 2.0},
                                     {"presence_penalty": 2.0, "repetition_penalty": 1.2}])
def test_causal_model_with_a_penalty_matches_the_ar_decoder(penalty):
    from celeris.reference.autoregressive import generate_autoregressive

    model = tiny_model(is_causal=True)
    params = SamplingParams(max_tokens=12, steps=12, block_length=1, cache="delayed", early_exit=False, **penalty)
    want = generate_autoregressive(model, PROMPTS, params).answer_ids
    plain = generate_autoregressive(model, PROMPTS, SamplingParams(max_tokens=12, early_exit=False)).answer_ids
    assert not torch.equal(want, plain)  # the penalty changes the answers: a real check
    engine = Engine(model, EngineConfig(max_num_seqs=8))
    requests = [engine.add_request(p, params) for p in PROMPTS]
    run_to_end(engine)
    for i, r in enumerate(requests):
        assert torch.equal(r.answer, want[i]), f"row {i}"


@pytest.mark.parametrize(("params", "suffix", "match"), [
    (SamplingParams(block_length=4), None, "block_length must be 1"),
    (SamplingParams(block_length=1, cfg_scale=1.0), None, "cfg_scale must be 0"),
    (SamplingParams(block_length=1, cache="dual"), None, "cache must be 'delayed' or 'none'"),
    (SamplingParams(block_length=1, cache="dual_delayed"), None, "cache must be 'delayed' or 'none'"),
    (SamplingParams(block_length=1), [7, 8], "suffix"),
])
def test_causal_model_refuses_what_it_cannot_decode(params, suffix, match):
    engine = Engine(tiny_model(is_causal=True), EngineConfig())
    with pytest.raises(ValueError, match=match):
        engine.add_request([5, 6], params, suffix)
    with pytest.raises(ValueError, match=match):
        generate(engine.model, [[5, 6]], params, [suffix] if suffix else None)


@pytest.mark.parametrize("early_exit", [False, True])
def test_dual_delayed_cache_with_infilling_matches_reference_sampler(early_exit):
    """dual_delayed's block-start window runs to the end of the canvas, over the suffix too (and, in the
    reference sampler, the right padding of shorter suffixes): the engine gives the same text, an uneven
    last block included; with cache_refresh 1 it is exactly the dual cache."""
    model = tiny_model()
    suffixes = [[20, 21, 22], [], [30]]
    params = SamplingParams(max_tokens=18, steps=18, block_length=4, cache="dual_delayed", early_exit=early_exit)
    reference = generate(model, PROMPTS, params, suffixes)
    engine = Engine(model, EngineConfig(max_num_seqs=8))
    requests = [engine.add_request(p, params, s) for p, s in zip(PROMPTS, suffixes, strict=True)]
    run_to_end(engine)
    eos = model.config.eos_token_id
    for i, r in enumerate(requests):
        assert r.final_prefix(eos) == reference.token_ids[i], f"row {i}"
    every_block = SamplingParams(max_tokens=18, steps=18, block_length=4, cache="dual_delayed", cache_refresh=1,
                                 early_exit=early_exit)
    dual = SamplingParams(max_tokens=18, steps=18, block_length=4, cache="dual", early_exit=early_exit)
    assert torch.equal(generate(model, PROMPTS, every_block, suffixes).answer_ids,
                       generate(model, PROMPTS, dual, suffixes).answer_ids)


@pytest.fixture(scope="module", params=["llada", "dream"])
def format_model(request, tmp_path_factory):
    """A tiny LLaDA or Dream folder, loaded (the published formats; Dream scores each column from the one before)."""
    folder = tmp_path_factory.mktemp(request.param)
    (write_llada if request.param == "llada" else write_dream)(folder, num_shards=1)
    return load_any(folder)


@pytest.mark.parametrize("cache", ["prefix", "dual", "delayed", "dual_delayed"])
def test_engine_with_cache_matches_reference_sampler(format_model, cache):
    """The engine's block-aligned padded window passes give the reference sampler's tokens on both formats."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    params = SamplingParams(max_tokens=12, steps=12, block_length=4, early_exit=False, cache=cache)
    reference = generate(format_model, prompts, params)
    engine = Engine(format_model, EngineConfig(max_num_seqs=4))
    requests = [engine.add_request(p, params) for p in prompts]
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        engine.step()
    for i, r in enumerate(requests):
        assert torch.equal(r.answer, reference.answer_ids[i]), f"row {i}"


@pytest.mark.parametrize("cache, suffix_window", [("prefix", 0), ("dual_delayed", 0), ("dual_delayed", 3)])
def test_engine_out_of_phase_requests_match_reference_sampler(format_model, cache, suffix_window):
    """Requests out of phase (two join one step late): the rows recomputing the masked suffix run their window
    pass apart from the others (``ModelRunner.num_split_passes``), and each request still gets the reference
    sampler's tokens for its prompt alone, on both formats (Dream scores each column from the one before it)."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    params = SamplingParams(max_tokens=12, steps=12, block_length=2, early_exit=False, cache=cache,
                            suffix_window=suffix_window)
    alone = [generate(format_model, [p], params).answer_ids[0] for p in prompts]
    engine = Engine(format_model, EngineConfig(max_num_seqs=4))
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


def test_the_end_of_text_fill_does_not_count_for_the_frequency_penalty():
    """A masked-diffusion answer whose text ends after three tokens, then the end-of-text fill (LLaDA's layout, the
    fill committed first: it is the most confident). Counting the fill would push the end-of-text logit down by
    frequency_penalty times its length and turn the model's end into a fourth token (vLLM never counts past the
    end); the engine and the reference sampler both end after three tokens."""
    from tests.conftest import ScriptedModel, tiny_config

    cfg = tiny_config()
    vocab, eos = cfg.vocab_size, cfg.eos_token_id

    def table(position: int) -> torch.Tensor:
        x, a = torch.zeros(vocab), position - 2  # a: the answer position
        if 0 <= a <= 2:
            x[10 + a] = 8.0
        elif a == 3:
            x[eos], x[13] = 4.0, 3.5  # the model ends here
        elif a >= 4:
            x[eos] = 10.0  # the end-of-text fill
        return x

    model = ScriptedModel(cfg, table)
    for penalty in (0.0, 1.0):
        params = SamplingParams(max_tokens=8, steps=8, block_length=8, early_exit=False, frequency_penalty=penalty)
        assert generate(model, [[5, 6]], params).token_ids == [[10, 11, 12]], penalty
        engine = Engine(model, EngineConfig(max_num_seqs=2))
        request = engine.add_request([5, 6], params)
        run_to_end(engine)
        assert request.answer[:4].tolist() == [10, 11, 12, eos], penalty


def test_next_token_answer_counts_grow_as_the_full_count_gives_them():
    """The masked path's kept answer counts (next-token decoding with a frequency penalty) equal ``answer_counts``
    over the answer at every step: tokens repeated, an end id in the middle (nothing after it counts), and an answer
    reset to masks (counted again from the start)."""
    from celeris.sampling.step import answer_counts

    model = tiny_model(is_causal=True)
    engine = Engine(model, EngineConfig(max_num_seqs=1))
    eos, vocab, mask = model.config.eos_token_id, model.config.vocab_size, model.config.mask_token_id
    params = SamplingParams(max_tokens=8, steps=8, block_length=1, cache="delayed", early_exit=False,
                            frequency_penalty=0.5)
    r = engine.add_request([5, 6, 7], params)
    path = engine.path("masked")
    answer = [9, 9, 11, eos, 9, 12, 9, 13]
    for step in [*range(9), 2, 5]:  # the last two: the answer reset to its first 2, then grown again
        r.block_idx = min(step, len(r.blocks) - 1)
        r.canvas[r.answer_start :] = mask
        r.canvas[r.answer_start : r.answer_start + step] = torch.tensor(answer[:step])
        kept = path._answer_counts(r, vocab, torch.device("cpu"))
        want = answer_counts([r.canvas[r.answer_start : r.block_span[0]]], vocab, mask, torch.device("cpu"),
                             [r.ends(eos)])[0]
        assert torch.equal(kept, want), step
    assert float(kept[9]) == 2  # the 9s after the end id are not counted
