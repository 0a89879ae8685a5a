"""Chunked prefill (``celeris.engine.scheduler``): a prompt longer than ``max_num_batched_tokens`` is prefilled a
chunk per step, on the verified path and on the masked path of a causal model under the ``delayed`` cache; its
tokens are those of a whole prefill, running requests commit a token at every step meanwhile, and no step's token
cost exceeds the budget. Steps are counted, never timed."""

from __future__ import annotations

import copy

import pytest
import torch

from celeris.config import EngineConfig
from celeris.engine import Engine
from celeris.engine.request import Request
from celeris.reference.autoregressive import generate_autoregressive
from celeris.reference.masked import generate
from celeris.sampling.drafter import DFlashProposer, attach, proposer_of
from celeris.sampling.params import SamplingParams
from tests.conftest import tiny_model
from tests.engine.test_engine import run_to_end
from tests.sampling.test_drafter import drafter_for

LONG = [(7 * i + 3) % 50 + 2 for i in range(37)]  # 37 prompt tokens
SHORT = [5, 6, 7]
AR = SamplingParams(max_tokens=8, steps=8, block_length=1, cache="delayed", early_exit=False)
VERIFIED = SamplingParams(max_tokens=8, steps=8, block_length=1, decoding="verified", early_exit=False)
DFLASH = SamplingParams(max_tokens=12, steps=12, block_length=1, decoding="verified", early_exit=False,
                        draft_source="dflash")


@pytest.fixture(scope="module")
def hybrid():
    """A tiny causal Celeris model with draft slots: next-token (masked, ``delayed``) and verified decoding."""
    return tiny_model(seed=4, is_causal=True, draft_block_size=3)


def spy_schedule(engine: Engine) -> list[tuple[int, dict[str, int]]]:
    """Record, for every step, the scheduled batch's token cost and each prefilling request's chunk."""
    log: list[tuple[int, dict[str, int]]] = []
    schedule = engine.scheduler.schedule

    def recorded() -> list[Request]:
        batch = schedule()
        chunks = {r.request_id: r.prefill_chunk for r in batch if r.is_prefilling}
        log.append((engine.scheduler.batch_tokens(batch), chunks))
        return batch

    engine.scheduler.schedule = recorded
    return log


def run(engine: Engine) -> None:
    run_to_end(engine, max_steps=1000)


@pytest.mark.parametrize("params", [AR, VERIFIED], ids=["masked-causal", "verified"])
@pytest.mark.parametrize("chunk", [1, 5, 12, 36])
def test_chunked_prefill_gives_the_whole_prefills_tokens(hybrid, params, chunk):
    """Alone, with a budget of ``chunk`` columns, the long prompt is prefilled ``chunk`` columns a step (5 does not
    divide the columns it prefills ahead); its tokens equal one whole prefill's and the references'."""
    whole = Engine(hybrid, EngineConfig(max_num_seqs=2))
    want = whole.add_request(LONG, params)
    run(whole)
    assert want.prefill_target == 0  # a budget that holds the prompt: no chunks
    engine = Engine(hybrid, EngineConfig(max_num_seqs=2, max_num_batched_tokens=chunk))
    log = spy_schedule(engine)
    request = engine.add_request(LONG, params)
    run(engine)
    eos = hybrid.config.eos_token_id
    assert request.final_prefix(eos) == want.final_prefix(eos)
    assert request.final_prefix(eos) == generate_autoregressive(hybrid, [LONG], params).token_ids[0]
    if params is AR:  # the masked reference sampler, as the engine == reference tests compare
        assert torch.equal(request.answer, generate(hybrid, [LONG], params).answer_ids[0])
    ahead = len(LONG) if params is AR else len(LONG) - 1  # the verified pass computes the last prompt column
    assert request.prefill_target == request.num_computed == ahead
    chunks = [c[request.request_id] for _, c in log if request.request_id in c]
    assert sum(chunks) == ahead and chunks == [chunk] * (ahead // chunk) + ([ahead % chunk] if ahead % chunk else [])
    assert request.nfe == want.nfe + len(chunks)  # each chunk is a pass it took part in


@pytest.mark.parametrize("params", [AR, VERIFIED], ids=["masked-causal", "verified"])
def test_running_request_commits_every_step_while_a_long_prompt_prefills(hybrid, params):
    """A running request commits at least one token at every step while the long prompt is prefilled in chunks,
    and the long request emits nothing until its prefill is done; both get their solo tokens."""
    # 36 columns: the short request's whole prefill fits (3 + 2 x MAX_DRAFTS draft columns under verification)
    engine = Engine(hybrid, EngineConfig(max_num_seqs=2, max_num_batched_tokens=36))
    running = engine.add_request(SHORT, SamplingParams(**{**_fields(params), "max_tokens": 24, "steps": 24}))
    engine.step()
    assert running.prefill_target == 0 and running.num_steps == 1
    long = engine.add_request(LONG, params)
    prefill_steps = 0
    emitted_early = []
    for _ in range(100):
        if not long.is_prefilling and prefill_steps:
            break
        before = int((running.answer != hybrid.config.mask_token_id).sum())
        outputs = engine.step()
        emitted_early += [o.new_token_ids for o in outputs if o.request is long and long.is_prefilling]
        assert int((running.answer != hybrid.config.mask_token_id).sum()) > before, f"step {prefill_steps}"
        prefill_steps += 1
    assert prefill_steps >= 2 and long.prefill_target  # the prompt took several steps: a real check of the steps in between
    assert emitted_early == [] and long.num_steps == 0 and not long.is_finished
    run(engine)
    eos = hybrid.config.eos_token_id
    assert long.final_prefix(eos) == generate_autoregressive(hybrid, [LONG], params).token_ids[0]
    assert running.final_prefix(eos) == generate_autoregressive(hybrid, [SHORT], running.params).token_ids[0]


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in ("block_length", "cache", "decoding", "early_exit")}


@pytest.mark.parametrize("budget", [9, 16, 30])
def test_no_step_with_a_chunk_in_flight_exceeds_the_token_budget(hybrid, budget):
    """A running next-token request, then a long verified and a long masked prompt: every step that prefills a
    chunk costs at most ``max_num_batched_tokens``, as the engine's paths count it."""
    engine = Engine(hybrid, EngineConfig(max_num_seqs=4, max_num_batched_tokens=budget))
    log = spy_schedule(engine)
    first = engine.add_request(SHORT, AR)
    engine.step()
    longs = [engine.add_request(LONG, VERIFIED), engine.add_request(LONG[::-1], AR)]
    run(engine)
    in_flight = [cost for cost, chunks in log if chunks]
    assert len(in_flight) >= 4 and max(in_flight) <= budget, in_flight
    assert all(r.prefill_target for r in longs)
    eos = hybrid.config.eos_token_id
    for request, prompt in zip([first, *longs], [SHORT, LONG, LONG[::-1]], strict=True):
        assert request.final_prefix(eos) == generate_autoregressive(hybrid, [prompt], request.params).token_ids[0]


def test_a_bidirectional_models_long_prompt_is_prefilled_whole():
    """Masked diffusion of a bidirectional model cannot chunk its prompt (its keys/values depend on the answer):
    the request is admitted whole when nothing else runs, as before."""
    model = tiny_model()
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=8))
    request = engine.add_request(LONG, SamplingParams(max_tokens=8, steps=8, block_length=4, cache="delayed"))
    engine.step()
    assert request.prefill_target == 0 and request.num_steps == 1


def test_chunked_verified_prefill_fills_and_reads_the_prefix_cache(hybrid):
    """A verified prompt prefilled in chunks stores its full blocks in the prefix cache; a later prompt sharing them
    starts its chunks after the cached prefix; both get their solo tokens."""
    engine = Engine(hybrid, EngineConfig(max_num_seqs=2, max_num_batched_tokens=8, enable_prefix_caching=True))
    first = engine.add_request(LONG, VERIFIED)
    run(engine)
    log = spy_schedule(engine)
    second = engine.add_request([*LONG, 9, 10], VERIFIED)
    run(engine)
    assert first.prefill_target and second.prefill_target
    assert engine.stats().prefix_cache_hits == 32  # LONG's two full blocks of 16, written by its chunk passes
    # its 6 columns past the cached 32 take one chunk (of at most 8), where 38 columns would take five
    assert len([c for _, c in log if second.request_id in c]) == 1 and second.num_computed == len(LONG) + 1
    eos = hybrid.config.eos_token_id
    for request in (first, second):
        assert request.final_prefix(eos) == generate_autoregressive(hybrid, [request.prompt_ids],
                                                                    VERIFIED).token_ids[0]


@pytest.mark.parametrize("params", [AR, VERIFIED], ids=["masked-causal", "verified"])
def test_a_request_finishing_mid_prefill_leaves_the_prefills_cache(hybrid, params):
    """A short request finishes (and frees its KV row, the last rows moving into the holes) while the long prompt is
    still being prefilled between two later requests: the long request's row and the chunks in it stay, and every
    request gets its solo tokens."""
    engine = Engine(hybrid, EngineConfig(max_num_seqs=4, max_num_batched_tokens=60))
    short = engine.add_request(SHORT, SamplingParams(**{**_fields(params), "max_tokens": 2, "steps": 2}))
    engine.step()
    long = engine.add_request(LONG, params)
    later = [engine.add_request(p, SamplingParams(**{**_fields(params), "max_tokens": 12, "steps": 12}))
             for p in ([8, 9], [10, 11])]
    finished_mid_prefill = 0
    while engine.has_unfinished():
        was_running = not short.is_finished
        engine.step()
        finished_mid_prefill += long.is_prefilling and was_running and short.is_finished
    assert finished_mid_prefill and long.prefill_target and all(r.num_steps for r in later)
    eos = hybrid.config.eos_token_id
    for request in (long, *later):
        assert request.final_prefix(eos) == generate_autoregressive(hybrid, [request.prompt_ids],
                                                                    request.params).token_ids[0]


@pytest.fixture(scope="module")
def with_drafter(hybrid):
    """A copy of the hybrid with a DFlash drafter attached (block 5: 4 drafts a pass)."""
    model = copy.deepcopy(hybrid)
    attach(model, DFlashProposer(drafter_for(model), model))
    return model


@pytest.fixture
def drafter_log(with_drafter):
    """Every drafter call's (block start, argmax drafts), in order, while the test runs."""
    proposer, log = proposer_of(with_drafter), []

    def spy(state: object, last_token: int, start: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, ids = type(proposer).propose_draft_vocab(proposer, state, last_token, start, k)
        top = logits.argmax(-1)
        log.append((start, (top if ids is None else ids[top]).tolist()))
        return logits, ids

    proposer.propose_draft_vocab = spy  # what the DFlash proposer calls
    yield log
    del proposer.propose_draft_vocab


def drafted_run(model: torch.nn.Module, config: EngineConfig, prompts: list[list[int]],
                log: list) -> tuple[Engine, list[Request], list]:
    """Serve ``prompts`` one after another on one engine; the engine, the requests and the drafter calls made."""
    engine = Engine(model, config)
    requests = []
    for prompt in prompts:
        requests.append(engine.add_request(prompt, DFLASH))
        run(engine)
    calls, log[:] = list(log), []
    return engine, requests, calls


@pytest.mark.parametrize("chunk", [1, 5, 12])
def test_chunked_prefill_with_a_drafter_gives_the_whole_prefills_drafts(with_drafter, drafter_log, chunk):
    """With a DFlash drafter, each chunk's target features enter the drafter's context: the drafter drafts the same
    blocks as after one whole prefill, and the tokens are the whole prefill's."""
    _, (want,), whole = drafted_run(with_drafter, EngineConfig(max_num_seqs=2), [LONG], drafter_log)
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=chunk)
    _, (request,), chunked = drafted_run(with_drafter, config, [LONG], drafter_log)
    assert want.prefill_target == 0 and request.prefill_target == request.num_computed == len(LONG) - 1
    assert chunked == whole and len(whole) == request.drafter_passes > 1 and whole[0][0] == len(LONG)
    eos = with_drafter.config.eos_token_id
    assert request.final_prefix(eos) == want.final_prefix(eos)
    assert request.final_prefix(eos) == generate_autoregressive(with_drafter, [LONG], DFLASH).token_ids[0]


def test_chunked_prefill_with_a_drafter_fills_and_reads_the_prefix_cache(with_drafter, drafter_log):
    """Chunks of 5 end mid-block: the prefix cache still stores the features of LONG's two full blocks (gathered
    over the chunks), and a later prompt sharing them drafts as it does alone with a whole prefill."""
    prompts = [LONG, [*LONG, 9, 10]]
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=5, enable_prefix_caching=True)
    engine, requests, chunked = drafted_run(with_drafter, config, prompts, drafter_log)
    assert all(r.prefill_target for r in requests) and engine.stats().prefix_cache_hits == 32
    assert engine.drafter.feature_cache.hit_tokens == 32  # the second starts its chunks after the cached 32
    alone = []
    for prompt in prompts:
        alone += drafted_run(with_drafter, EngineConfig(max_num_seqs=2), [prompt], drafter_log)[2]
    assert chunked == alone


def test_blocks_without_drafter_features_serve_no_drafted_request(with_drafter, drafter_log):
    """Next-token decoding stores LONG's two blocks with no drafter features; a DFlash request on LONG then reuses
    none of them (its drafter would lack their context), and the engine counts no hit for it: a hit is what a
    request took, not what the cache held. Once the verified request has stored its features, the same prompt hits."""
    engine = Engine(with_drafter, EngineConfig(max_num_seqs=2, enable_prefix_caching=True))
    engine.add_request(LONG, AR)
    run(engine)
    assert engine.stats().prefix_cache_hits == 0 and len(engine.runner.kv.prefix_cache.blocks) == 2
    drafted = engine.add_request(LONG, DFLASH)
    run(engine)
    assert engine.stats().prefix_cache_hits == 0 and engine.stats().prefix_cache_queries == 2 * len(LONG)
    again = engine.add_request(LONG, DFLASH)
    run(engine)
    assert engine.stats().prefix_cache_hits == 32 == engine.drafter.feature_cache.hit_tokens
    eos = with_drafter.config.eos_token_id
    want = generate_autoregressive(with_drafter, [LONG], DFLASH).token_ids[0]
    assert drafted.final_prefix(eos) == again.final_prefix(eos) == want
