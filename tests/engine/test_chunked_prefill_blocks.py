"""Chunked prefill on the block path (``celeris.engine.blocks``): a block-diffusion prompt longer than
``max_num_batched_tokens`` computes its history (the columns before its first attention block) a chunk per step,
in the running rows' pass; its tokens are a whole prefill's and the reference block sampler's
(``celeris.reference.block.generate_block``), running rows commit at every step meanwhile, and no step's token
cost exceeds the budget. SDAR and Fast-dLLM v2 (``block_causal``: a history column sees its whole block, so chunks
are whole blocks) and the Celeris hybrid (``causal_history``: any chunk), float64 as in ``test_blocks``. Steps are
counted, never timed."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from celeris.config import EngineConfig
from celeris.engine import Engine
from celeris.engine.request import Request
from celeris.models.loader import load_any
from celeris.reference.autoregressive import generate_autoregressive
from celeris.reference.block import generate_block
from celeris.sampling.params import SamplingParams
from tests.engine.test_chunked_prefill import LONG, SHORT, run, spy_schedule
from tests.models.conftest_block_formats import write_fast_dllm, write_llada2, write_sdar

FORMATS = ["sdar", "fast_dllm_v2", "hybrid"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, hybrid) -> dict[str, torch.nn.Module]:
    """The tiny block models by format: SDAR (blocks of 4), Fast-dLLM v2 (8, shifted logits, first token alone),
    LLaDA2.0 (32, steps capped at the answer) and the engine tests' Celeris hybrid (4, ``causal_history``, shifted,
    first token alone)."""
    found = {"hybrid": hybrid}
    for name, write in (("sdar", write_sdar), ("fast_dllm_v2", write_fast_dllm), ("llada2", write_llada2)):
        folder = tmp_path_factory.mktemp(name)
        write(folder, scale=3.0)
        found[name] = load_any(folder, dtype=torch.float64)
    return found


def params_for(model: torch.nn.Module, **settings) -> SamplingParams:
    """A sub-block of half the attention block (the whole block when it is 4), as ``test_blocks`` decodes."""
    block = model.block_contract.block_size
    base = {"max_tokens": 11, "steps": 2, "block_length": block // 2 if block > 4 else block, "early_exit": False}
    return SamplingParams(**(base | settings))


def chunk_width(model: torch.nn.Module, budget: int) -> int:
    """The columns a lone prefill computes per step: the budget, in whole blocks under ``block_causal``."""
    contract = model.block_contract
    return budget // contract.block_size * contract.block_size if contract.attention == "block_causal" else budget


def prefill_steps(engine: Engine, request: Request) -> list[int]:
    """Step ``engine`` until ``request``'s chunked prefill is done; the prompt columns each step added."""
    added = []
    for _ in range(1000):
        if not request.is_prefilling and request.prefill_target:
            return added
        before = request.num_computed
        engine.step()
        added.append(request.num_computed - before)
    raise AssertionError("the prefill did not finish")


def answer_of(model: torch.nn.Module, prompt: list[int], params: SamplingParams) -> list[int]:
    return generate_block(model, [prompt], params).answer_ids[0].tolist()


# (format, budget): 6 and 13 do not hold whole blocks of 4 (SDAR: chunks of 4 and 12), 12 and 20 not of 8
# (Fast-dLLM v2: 8 and 16); the hybrid's chunks are the budget, 3 and 5 dividing neither the block of 4 nor 36
CASES = [("sdar", 4), ("sdar", 6), ("sdar", 13), ("fast_dllm_v2", 8), ("fast_dllm_v2", 12), ("fast_dllm_v2", 20),
         ("hybrid", 1), ("hybrid", 3), ("hybrid", 5), ("hybrid", 12)]


@pytest.mark.parametrize("prompt", [LONG, LONG[:32]], ids=["37-tokens", "32-tokens"])
@pytest.mark.parametrize(("name", "budget"), CASES)
def test_block_chunked_prefill_gives_the_whole_prefills_tokens(models, name, budget, prompt):
    """Alone, with a budget of ``budget`` columns, the prompt's full blocks are prefilled a chunk per step (whole
    blocks under ``block_causal``); the answer equals a whole prefill's and the reference's. The 32-token prompt
    ends on a block boundary: its first block's first token (Fast-dLLM v2, hybrid) is scored from the last
    prefilled column."""
    model = models[name]
    params = params_for(model)
    whole = Engine(model, EngineConfig(max_num_seqs=2))
    want = whole.add_request(prompt, params)
    run(whole)
    assert want.prefill_target == 0  # a budget that holds the prompt: no chunks
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=budget))
    log = spy_schedule(engine)
    request = engine.add_request(prompt, params)
    added = prefill_steps(engine, request)
    run(engine)
    assert request.answer.tolist() == want.answer.tolist() == answer_of(model, prompt, params)
    bs = model.block_contract.block_size
    ahead = len(prompt) // bs * bs  # the history before the first attention block (absolute alignment)
    chunk = chunk_width(model, budget)
    assert request.prefill_target == request.num_computed == ahead
    assert added == [chunk] * (ahead // chunk) + ([ahead % chunk] if ahead % chunk else [])
    assert request.nfe == want.nfe + len(added)  # each chunk is a pass it took part in
    assert max(cost for cost, chunks in log if chunks) <= budget


def test_llada2_chunks_are_whole_blocks_of_32(models):
    """LLaDA2.0 (``block_causal``, blocks of 32): a 74-token prompt with a budget of 40 prefills its two full blocks
    a block a step; its answer equals a whole prefill's and the reference's."""
    model, prompt = models["llada2"], LONG + LONG
    params = params_for(model, max_tokens=6)
    whole = Engine(model, EngineConfig(max_num_seqs=2))
    want = whole.add_request(prompt, params)
    run(whole)
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=40))
    request = engine.add_request(prompt, params)
    assert prefill_steps(engine, request) == [32, 32]
    run(engine)
    assert request.answer.tolist() == want.answer.tolist() == answer_of(model, prompt, params)
    assert request.nfe == want.nfe + 2


def test_a_block_prompt_is_prefilled_whole_where_no_chunk_fits(models):
    """A budget below one block under ``block_causal`` (SDAR: 3 < 4) holds no exact chunk, and a prompt shorter
    than a block has no history to prefill: both are admitted whole when nothing else runs, as before."""
    sdar, hybrid = models["sdar"], models["hybrid"]
    for model, prompt, budget in ((sdar, LONG, 3), (hybrid, SHORT, 1)):
        engine = Engine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=budget))
        request = engine.add_request(prompt, params_for(model))
        engine.step()
        assert request.prefill_target == 0 and request.num_steps == 1
        run(engine)
        assert request.answer.tolist() == answer_of(model, prompt, params_for(model))


@pytest.mark.parametrize(("name", "ahead"), [("hybrid", len(LONG)), ("sdar", 0)])
def test_answer_alignment_prefills_the_whole_prompt_as_history(models, name, ahead):
    """Under ``answer`` alignment the whole prompt is history: ``causal_history`` (the hybrid's layout) prefills it
    in chunks of any size (5 here); under ``block_causal`` it is one bidirectional block, prefilled whole. Both
    give the reference's tokens."""
    model = copy.deepcopy(models[name])
    model.block_contract = replace(model.block_contract, alignment="answer")
    params = params_for(model)
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=5))
    request = engine.add_request(LONG, params)
    run(engine)
    assert request.prefill_target == request.num_computed == ahead
    assert request.answer.tolist() == answer_of(model, LONG, params)


@pytest.mark.parametrize("name", FORMATS)
def test_running_block_row_commits_every_step_while_a_long_prompt_prefills(models, name):
    """A running block request commits at least one token at every step while the long prompt is prefilled in
    chunks in the same passes, and the long request emits nothing until its prefill is done; both get the
    reference's tokens."""
    model = models[name]
    bs = model.block_contract.block_size
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=6 * bs))
    log = spy_schedule(engine)
    slow = params_for(model, max_tokens=24, steps=bs, decoding="fixed")  # a token a step
    running = engine.add_request(SHORT, slow)
    engine.step()
    assert running.prefill_target == 0 and running.num_steps == 1
    long = engine.add_request(LONG, params_for(model))
    mask_id, steps, emitted_early = model.config.mask_token_id, 0, []
    while long.is_prefilling or not steps:
        before = int((running.answer != mask_id).sum())
        emitted_early += [o.new_token_ids for o in engine.step() if o.request is long]
        assert int((running.answer != mask_id).sum()) > before, f"step {steps}"
        steps += 1
    assert steps >= 2 and long.prefill_target  # several steps: a real check of the steps in between
    assert emitted_early == [] and long.num_steps == 0 and not running.is_finished
    assert max(cost for cost, chunks in log if chunks) <= 6 * bs
    run(engine)
    assert long.answer.tolist() == answer_of(model, LONG, long.params)
    assert running.answer.tolist() == answer_of(model, SHORT, slow)


def test_next_token_request_commits_while_a_block_prompt_prefills(models):
    """On the hybrid, a running next-token request (the masked path) commits a token at every step while a block
    request's prompt is prefilled in chunks (the block path): the budget counts both paths' columns."""
    hybrid = models["hybrid"]
    engine = Engine(hybrid, EngineConfig(max_num_seqs=2, max_num_batched_tokens=16))
    log = spy_schedule(engine)
    token = SamplingParams(max_tokens=16, steps=16, block_length=1, cache="delayed", early_exit=False)
    running = engine.add_request(SHORT, token)
    engine.step()
    long = engine.add_request(LONG, params_for(hybrid))
    steps = 0
    while long.is_prefilling or not steps:
        before = int((running.answer != hybrid.config.mask_token_id).sum())
        engine.step()
        assert int((running.answer != hybrid.config.mask_token_id).sum()) == before + 1, f"step {steps}"
        steps += 1
    assert steps >= 3 and long.prefill_target == len(LONG) // 4 * 4 and long.num_steps == 0
    assert max(cost for cost, chunks in log if chunks) <= 16
    run(engine)
    assert long.answer.tolist() == answer_of(hybrid, LONG, long.params)
    assert running.final_prefix(hybrid.config.eos_token_id) == generate_autoregressive(hybrid, [SHORT],
                                                                                      token).token_ids[0]


@pytest.mark.parametrize("budget", [16, 24, 40])
@pytest.mark.parametrize("name", FORMATS)
def test_no_step_with_a_block_chunk_in_flight_exceeds_the_token_budget(models, name, budget):
    """A running block request, then two long block prompts prefilling side by side: every step that holds a
    prefill costs at most ``max_num_batched_tokens`` (rows x the widest row's columns, as the block path counts
    them), and every request gets the reference's tokens."""
    model = models[name]
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=budget))
    log = spy_schedule(engine)
    first = engine.add_request(SHORT, params_for(model))
    engine.step()
    longs = [engine.add_request(prompt, params_for(model, max_tokens=7)) for prompt in (LONG, LONG[::-1])]
    run(engine)
    in_flight = [cost for cost, chunks in log if chunks]
    assert len(in_flight) >= 2 and max(in_flight) <= budget, in_flight
    assert all(r.prefill_target for r in longs)
    for request in (first, *longs):
        assert request.answer.tolist() == answer_of(model, request.prompt_ids, request.params)


@pytest.mark.parametrize("name", FORMATS)
def test_a_block_request_finishing_mid_prefill_leaves_the_prefills_cache(models, name):
    """A short block request finishes (its KV row freed, the last row moving into the hole) while the long prompt
    is still being prefilled beside a later request: the long request's row, its chunks and its cursor move with
    it, and every request gets the reference's tokens."""
    model = models[name]
    bs = model.block_contract.block_size
    engine = Engine(model, EngineConfig(max_num_seqs=3, max_num_batched_tokens=3 * bs))
    short = engine.add_request(SHORT, params_for(model, max_tokens=2))
    engine.step()
    long = engine.add_request(LONG, params_for(model))
    later = engine.add_request([8, 9], params_for(model, max_tokens=12))
    finished_mid_prefill = 0
    while engine.has_unfinished():
        was_running = not short.is_finished
        engine.step()
        finished_mid_prefill += long.is_prefilling and was_running and short.is_finished
    assert finished_mid_prefill and long.prefill_target and later.num_steps
    for request in (short, long, later):
        assert request.answer.tolist() == answer_of(model, request.prompt_ids, request.params)


def test_a_paused_block_prefill_sits_the_pass_out(models):
    """SDAR, budget 16: while the running row's pass is wide, the two prefills get no chunk (0) and their rows sit
    the pass out (not counted, not computed, not a pass in their ``nfe``); they resume when there is room, each
    chunk whole blocks, and give the reference's tokens."""
    model = models["sdar"]
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16))
    log = spy_schedule(engine)
    first = engine.add_request(SHORT, params_for(model))
    engine.step()
    longs = [engine.add_request(prompt, params_for(model, max_tokens=7)) for prompt in (LONG, LONG[::-1])]
    history: list[tuple[int, ...]] = []
    while any(r.is_prefilling for r in longs) or not history:
        engine.step()
        history.append(tuple(r.num_computed for r in longs))
    chunks = [c for _, c in log if c]
    paused = [i for i, c in enumerate(chunks) if 0 in c.values()]
    assert paused and max(cost for cost, c in log if c) <= 16
    for i in paused:  # a paused request's prompt columns did not move that step
        before = history[i - 1] if i else (0, 0)
        for r, was, now in zip(longs, before, history[i], strict=True):
            assert chunks[i].get(r.request_id) != 0 or now == was
    assert all(n % 4 == 0 for step in history for n in step)  # whole blocks of 4
    for r in longs:
        steps_with_a_chunk = sum(c.get(r.request_id, 0) > 0 for c in chunks)
        assert r.nfe == steps_with_a_chunk + r.num_steps  # a paused step is no pass of its
    run(engine)
    for request in (first, *longs):
        assert request.answer.tolist() == answer_of(model, request.prompt_ids, request.params)
