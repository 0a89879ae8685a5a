"""Log-probabilities through the engine (``celeris.sampling.logprobs``), against a full causal pass over prompt +
answer (the slow obviously-correct scorer: no cache, no drafts) for next-token and verified decoding, against the one
pass that commits every token for a one-step diffusion answer, and asking for nothing computes nothing."""

from __future__ import annotations

import math

import pytest
import torch

from celeris.llm import LLM
from celeris.sampling.logprobs import FLOOR, prompt_entries
from celeris.sampling.select import top_k_filter
from tests.engine.test_blocks import params_for, run_engine  # noqa: F401 (the block models' fixture helpers)
from tests.models.conftest_block_formats import write_sdar

PROMPT = "def add(a, b):\n"


@pytest.fixture(scope="module")
def ar():
    return LLM("celeris-code-6m-ar", device="cpu")


@pytest.fixture(scope="module")
def hybrid():
    return LLM("celeris-code-6m-hybrid", device="cpu")


def full_pass_logits(model, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1, V) logits, row i scoring token i + 1, from one uncached causal pass."""
    with torch.no_grad():
        return model(torch.tensor([ids]), None, logits_slice=slice(1, len(ids)))[0]


def check_against_full_pass(llm: LLM, out, k: int) -> None:
    ids = llm.tokenizer.encode(PROMPT)
    reference = prompt_entries(llm.model, ids + out.token_ids, k)[len(ids):]
    assert len(out.logprobs) == len(out.token_ids) == len(reference) > 0
    for got, want, token in zip(out.logprobs, reference, out.token_ids, strict=True):
        assert got.token_id == want.token_id == token
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4) and got.logprob <= 0
        assert [i for i, _ in got.top] == [i for i, _ in want.top] and len(got.top) == k
        assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-4)
        assert got.top[0][0] == token  # greedy: the returned token is the most likely one


@pytest.mark.parametrize("decoding", ["fixed", "verified"])
def test_next_token_and_verified_logprobs_equal_a_full_causal_pass(ar, hybrid, decoding):
    llm = ar if decoding == "fixed" else hybrid
    params = llm.default_params(max_tokens=10, logprobs=3, prompt_logprobs=2, decoding=decoding)
    out = llm.generate([PROMPT, "class Stack:"], params)[0]
    check_against_full_pass(llm, out, 3)
    ids = llm.tokenizer.encode(PROMPT)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    assert [e.logprob for e in out.prompt_logprobs[1:]] == pytest.approx(
        [e.logprob for e in prompt_entries(llm.model, ids, 2)[1:]], abs=1e-5)


def test_processed_logprobs_are_the_sampled_distribution(tmp_path):
    llm = LLM("celeris-code-6m-ar", device="cpu", logprobs_mode="processed_logprobs")
    params = llm.default_params(max_tokens=8, logprobs=2, temperature=0.7, top_k=5, seed=3)
    out = llm.generate([PROMPT], params)[0]
    ids = llm.tokenizer.encode(PROMPT)
    logits = full_pass_logits(llm.model, ids + out.token_ids)[len(ids) - 1:]  # (answer, V)
    want = torch.log_softmax(top_k_filter(logits[None], torch.tensor([5]))[0] / 0.7, -1)
    for j, e in enumerate(out.logprobs):
        assert e.logprob == pytest.approx(float(want[j, e.token_id]), abs=1e-4) and FLOOR < e.logprob <= 0
        assert len(e.top) == 2 and e.top[0][1] == pytest.approx(float(want[j].max()), abs=1e-4)
    raw = LLM("celeris-code-6m-ar", device="cpu").generate([PROMPT], params)[0]  # the same tokens, raw values
    assert raw.token_ids == out.token_ids
    assert [e.logprob for e in raw.logprobs] != pytest.approx([e.logprob for e in out.logprobs], abs=1e-3)


def test_one_step_diffusion_logprobs_are_its_pass():
    """A diffusion answer decoded in one step commits every token from one pass: each value is that pass's."""
    llm = LLM("celeris-code-6m", device="cpu")
    params = llm.default_params(max_tokens=6, steps=1, block_length=6, cache="none", logprobs=4, early_exit=False)
    out = llm.generate([PROMPT], params)[0]
    ids = llm.tokenizer.encode(PROMPT)
    canvas = torch.tensor([ids + [llm.model.config.mask_token_id] * 6])
    with torch.no_grad():
        logits = llm.model(canvas, None, logits_slice=slice(len(ids), len(ids) + 6))[0]
    want = torch.log_softmax(logits, -1)
    assert len(out.logprobs) == len(out.token_ids) > 0
    for j, e in enumerate(out.logprobs):
        assert e.token_id == out.token_ids[j]
        assert e.logprob == pytest.approx(float(want[j, e.token_id]), abs=1e-4)
        assert [i for i, _ in e.top] == want[j].topk(4).indices.tolist()
    with pytest.raises(ValueError, match="causal"):
        llm.generate([PROMPT], llm.default_params(max_tokens=4, prompt_logprobs=1))


def test_block_decoding_values_come_from_the_committing_step(tmp_path):
    """Greedy block decoding commits each token as its distribution's most likely one at the step that commits
    it, so the value reported is that distribution's maximum."""
    from celeris.models.loader import load_any

    write_sdar(tmp_path, scale=3.0)
    model = load_any(tmp_path, dtype=torch.float64)
    params = params_for(model, logprobs=2, max_tokens=7)
    (request,), _ = run_engine(model, [(0, [5, 6, 7], params)])
    assert sorted(request.logprob_entries) == list(range(7))
    for pos, e in request.logprob_entries.items():
        assert e.token_id == int(request.answer[pos])
        assert e.top[0] == (e.token_id, pytest.approx(e.logprob)) and e.logprob <= 0


def test_asking_for_nothing_computes_nothing(ar, hybrid, monkeypatch):
    import celeris.engine.engine as engine_module
    import celeris.engine.masked as masked_module  # the masked path's commit

    def refuse(*args, **kwargs):
        raise AssertionError("log-probabilities computed though no request asked")

    monkeypatch.setattr(masked_module, "committed_entries", refuse)
    monkeypatch.setattr(engine_module, "prompt_entries", refuse)
    out = ar.generate([PROMPT], ar.default_params(max_tokens=4))[0]
    assert out.logprobs is None and out.prompt_logprobs is None
    hybrid.generate([PROMPT], hybrid.default_params(max_tokens=4))
    assert hybrid.engine.drafter.raw_logits is None


def test_score_only_request_decodes_nothing(ar):
    ids = ar.tokenizer.encode(PROMPT)
    request = ar.engine.add_request(ids, ar.default_params(max_tokens=1, prompt_logprobs=0), score_only=True)
    outputs = ar.engine.step()
    assert [o.request for o in outputs] == [request] and outputs[0].finished and outputs[0].new_token_ids == []
    assert request.nfe == 1 and request.num_steps == 0
    assert [e.logprob for e in request.prompt_logprob_entries[1:]] == pytest.approx(
        [e.logprob for e in prompt_entries(ar.model, ids, 0)[1:]])
    assert all(math.isfinite(e.logprob) for e in request.prompt_logprob_entries[1:])


def test_prompt_scoring_in_chunks_equals_one_forward(ar, monkeypatch):
    import celeris.sampling.logprobs as logprobs

    ids = ar.tokenizer.encode(PROMPT + "    return a + b\n")
    want = torch.log_softmax(full_pass_logits(ar.model, ids), -1)
    monkeypatch.setattr(logprobs, "PROMPT_CHUNK", 3)
    got = prompt_entries(ar.model, ids, 2)
    assert got[0] is None and len(got) == len(ids)
    for i, e in enumerate(got[1:]):
        assert e.logprob == pytest.approx(float(want[i, ids[i + 1]]), abs=1e-5)
        assert [t for t, _ in e.top] == want[i].topk(2).indices.tolist()
