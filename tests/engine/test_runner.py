"""Model runner (``celeris.engine.runner``): KV-pool rows freed and reused as requests come and go; the
compiled runner gives the eager tokens."""

from __future__ import annotations

import pytest
import torch

from celeris.config import EngineConfig
from celeris.engine import Engine
from celeris.reference.masked import generate
from celeris.sampling.params import SamplingParams
from tests.conftest import tiny_model
from tests.engine.test_engine import PROMPTS, run_to_end


@pytest.mark.parametrize("cache", ["dual", "delayed", "dual_delayed", "prefix"])
def test_kv_pool_rows_survive_others_finishing_and_joining(cache):
    """Requests of different lengths and arrival steps share the runner's KV pool: rows are freed
    (the last row moved into the hole) and reused, and every request still gets its tokens alone."""
    model = tiny_model()
    lengths = [8, 20, 12, 16]
    params = [SamplingParams(max_tokens=n, steps=n, block_length=4, cache=cache, early_exit=False,
                             cfg_scale=1.0 if i == 1 else 0.0) for i, n in enumerate(lengths)]
    prompts = [*PROMPTS, [20, 21, 22, 23, 24]]
    alone = [generate(model, [p], sp).answer_ids[0] for p, sp in zip(prompts, params, strict=True)]
    engine = Engine(model, EngineConfig(max_num_seqs=8))
    requests = [engine.add_request(prompts[i], params[i]) for i in range(3)]
    for _ in range(6):
        engine.step()
    requests.append(engine.add_request(prompts[3], params[3]))  # joins after the first request has left
    pool = engine.runner.pool
    seen_rows = 0
    while engine.has_unfinished():
        engine.step()
        seen_rows = max(seen_rows, pool.num_rows)
        assert pool.num_rows == len(set(pool.owners)) and all(pool.row(r, k) == i for i, (r, k) in enumerate(pool.owners))
    assert seen_rows >= 3 and pool.num_rows == 0  # the last step freed every row
    for r, expected in zip(requests, alone, strict=True):
        assert torch.equal(r.answer, expected)
    if cache in ("dual_delayed", "prefix"):  # out of phase: some steps ran the wide rows in a pass of their own
        assert engine.runner.num_split_passes > 0


@pytest.mark.slow
def test_compiled_runner_gives_the_eager_tokens_in_the_block_and_verified_paths():
    """enforce_eager=False compiles the block path's and the verified path's entries into the model too
    (``ModelRunner.hidden_states`` / ``layout_hidden_states``); a hybrid model's block and verified requests,
    running together, get the eager tokens."""
    hybrid = tiny_model(seed=4, is_causal=True, draft_block_size=4)
    block = SamplingParams(max_tokens=8, block_length=4, steps=4, early_exit=False)
    verified = SamplingParams(max_tokens=8, steps=8, block_length=1, decoding="verified", early_exit=False)
    answers = []
    for eager in (True, False):
        engine = Engine(hybrid, EngineConfig(enforce_eager=eager))
        if not eager:
            assert engine.runner.hidden_states is not hybrid.hidden_states  # a compiled wrapper
        requests = [engine.add_request(PROMPTS[0], block), engine.add_request(PROMPTS[1], verified)]
        assert [r.mode for r in requests] == ["block", "verified"]
        run_to_end(engine)
        assert engine.drafter.entry is engine.runner and engine.block_decoder.entry is engine.runner
        answers.append([r.answer.tolist() for r in requests])
    assert answers[0] == answers[1]


@pytest.mark.slow
def test_compiled_runner_gives_the_eager_tokens():
    """enforce_eager=False wraps the model in torch.compile; tokens must not change."""
    model = tiny_model()
    params = SamplingParams(max_tokens=8, steps=8, block_length=8, early_exit=False)
    answers = []
    for eager in (True, False):
        engine = Engine(model, EngineConfig(enforce_eager=eager))
        request = engine.add_request(PROMPTS[0], params)
        run_to_end(engine)
        answers.append(request.answer)
    assert torch.equal(answers[0], answers[1])


def test_a_causal_models_decoding_step_computes_one_column():
    """The masked path of a causal model (``block_length`` 1, ``delayed``) scores token t from the hidden state at
    t - 1 and never computes the mask column t: every window pass of a lone request computes one column, the full
    pass that fills the cache stops at the first answer column (not the whole canvas of masks), and a batch of
    three ragged prompts gets the reference samplers' tokens (the masked loop, which computes every column, and
    the plain next-token loop)."""
    from celeris.reference.autoregressive import generate_autoregressive

    model = tiny_model(seed=4, is_causal=True)
    params = SamplingParams(max_tokens=10, steps=10, block_length=1, cache="delayed", early_exit=False)
    prompts = [[5, 6, 7], [9, 3, 11, 12, 4, 8], [13]]
    engine = Engine(model, EngineConfig(max_num_seqs=4))
    widths: list[int] = []
    hidden_states = engine.runner.hidden_states

    def spy(ids, mask, cache=None, window=None):  # noqa: ANN001, ANN202
        if isinstance(window, torch.Tensor):
            widths.append(window.shape[1])
        return hidden_states(ids, mask, cache, window)

    engine.runner.hidden_states = spy
    alone = engine.add_request(prompts[0], params)
    run_to_end(engine)
    assert widths == [1] * (params.max_tokens - 1)  # the first token comes from the full pass that fills the cache
    want_masked = generate(model, [prompts[0]], params).answer_ids[0]
    assert torch.equal(alone.answer, want_masked)
    exact = Engine(model, EngineConfig(max_num_seqs=4, length_bucket=1))  # full passes of unpadded widths
    full: list[int] = []
    model.register_forward_pre_hook(lambda m, args: full.append(args[0].shape[1]))  # the full passes' canvases
    requests = [exact.add_request(p, params) for p in prompts]
    run_to_end(exact)
    # each prompt and its first answer column, no more; prompts this ragged pass alone (no left padding)
    assert sorted(full) == sorted(len(p) + 1 for p in prompts)
    for p, r in zip(prompts, requests, strict=True):
        assert torch.equal(r.answer, generate(model, [p], params).answer_ids[0])
        assert r.answer.tolist() == generate_autoregressive(model, [p], params).token_ids[0]


def test_eager_passes_are_not_padded_to_the_length_bucket():
    """``length_bucket`` pads canvases only for compiled passes (few shapes): an eager engine with the default bucket
    (32) runs its causal prefill at the prompts' own width, a compiled one keeps the bucket."""
    model = tiny_model(seed=4, is_causal=True)
    params = SamplingParams(max_tokens=4, steps=4, block_length=1, cache="delayed", early_exit=False)
    eager = Engine(model, EngineConfig(max_num_seqs=2))
    assert EngineConfig().length_bucket == 32 and eager.runner.length_bucket == 1
    assert Engine(model, EngineConfig(enforce_eager=False)).runner.length_bucket == 32
    widths: list[int] = []
    model.register_forward_pre_hook(lambda m, args: widths.append(args[0].shape[1]))
    prompts = [[5, 6, 7], [9, 3, 11, 12, 4]]
    requests = [eager.add_request(p, params) for p in prompts]
    run_to_end(eager)
    assert sorted(widths) == [len(p) + 1 for p in prompts]  # each prompt alone (too ragged to pad), not 32
    for p, r in zip(prompts, requests, strict=True):
        assert torch.equal(r.answer, generate(model, [p], params).answer_ids[0])


@pytest.mark.slow
def test_compiled_runner_does_not_recompile_for_a_new_prompt_length():
    """The masked path's prefill passes ``logits_slice=slice(prompt_len, ...)``; compiled whole, the forward was
    guarded on those ints and recompiled for every prompt length (``CompiledForward``). Prompts of four lengths,
    one after another: the compiled graphs counted after the second equal those after the fourth, and every answer
    equals the eager runner's."""
    from torch._dynamo.utils import counters

    model = tiny_model(seed=4, is_causal=True)
    params = SamplingParams(max_tokens=6, steps=6, block_length=1, cache="delayed", early_exit=False)
    prompts = [[5, 6, 7], [9, 3, 11, 12, 4, 8], [13, 14, 15, 16, 17, 18, 19, 20, 21], [22, 23, 24, 25, 26]]
    eager = Engine(model, EngineConfig(length_bucket=1))
    compiled = Engine(model, EngineConfig(length_bucket=1, enforce_eager=False))
    graphs = []
    for prompt in prompts:
        want, got = eager.add_request(prompt, params), compiled.add_request(prompt, params)
        run_to_end(eager)
        run_to_end(compiled)
        assert torch.equal(got.answer, want.answer)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[3], graphs
