"""Engine faults (issue 13): every step makes progress or ends the request; a request's random draws are
a function of that request alone, whatever shares its step."""

from __future__ import annotations

import pytest
import torch

from celeris.config import EngineConfig
from celeris.engine import Engine
from celeris.reference.masked import generate
from celeris.sampling.params import SamplingParams
from celeris.sampling.step import NoProgressError
from tests.conftest import tiny_model
from tests.engine.test_engine import run_to_end

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def unchecked(params: SamplingParams, **values: float) -> SamplingParams:
    """``params`` with values set after validation (what a caller bypassing the bounds would send)."""
    for name, value in values.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize("values", [{"cfg_scale": 1e308}, {"cfg_scale": float("inf")},
                                    {"repetition_penalty": 1e-300}, {"top_p": 1e-50, "temperature": 1.0}])
def test_a_step_that_commits_nothing_ends_the_request(values):
    """Values float32 cannot hold make every confidence NaN; the engine ends that request after one step
    (finish reason "error", code "no_progress") and the other request in the batch finishes normally."""
    model = tiny_model()
    engine = Engine(model, EngineConfig(max_num_seqs=4))
    bad = engine.add_request(PROMPT, unchecked(SamplingParams(max_tokens=4, steps=4, block_length=4, seed=0),
                                               **values))
    good = engine.add_request(PROMPT, SamplingParams(max_tokens=4, steps=4, block_length=4))
    outputs = engine.step()
    if values.get("top_p") is None:  # a top_p that rounds to 0 keeps the top token: that one progresses
        assert bad.is_finished and bad.finish_reason == "error" and bad.error_code == "no_progress"
        assert "committed no token" in bad.error
        assert [o.finished for o in outputs if o.request is bad] == [True]
    run_to_end(engine)
    assert good.finish_reason in ("stop", "length")
    assert bad.is_finished


def test_nan_logits_end_the_request_not_the_loop():
    model = tiny_model()
    real_forward = model.forward

    def nan_forward(*args, **kwargs):
        return real_forward(*args, **kwargs) * float("nan")

    model.forward = nan_forward
    engine = Engine(model, EngineConfig(max_num_seqs=2))
    r = engine.add_request(PROMPT, SamplingParams(max_tokens=8, steps=8, block_length=4))
    engine.step()
    assert r.finish_reason == "error" and r.error_code == "no_progress" and not engine.has_unfinished()
    with pytest.raises(NoProgressError):
        generate(model, [PROMPT], SamplingParams(max_tokens=8, steps=8, block_length=4))


SAMPLED = SamplingParams(max_tokens=12, steps=12, block_length=4, temperature=0.8, seed=5, early_exit=False)
OTHERS = [
    ([12, 13], SamplingParams(max_tokens=12, steps=12, block_length=8, temperature=0.8, seed=1)),
    ([14, 15, 16, 17], SamplingParams(max_tokens=6, steps=6, block_length=2, temperature=1.0, seed=2,
                                      remasking="random")),
    ([20, 21, 22], SamplingParams(max_tokens=16, steps=8, block_length=16)),
]


@pytest.mark.parametrize("params", [SAMPLED, SamplingParams(max_tokens=12, steps=12, block_length=4,
                                                            temperature=1.0, seed=3, remasking="random",
                                                            early_exit=False)])
@pytest.mark.parametrize("others", [OTHERS[:1], OTHERS[1:2], OTHERS])
def test_seed_gives_the_same_tokens_whatever_shares_the_step(params, others):
    """Issue 13 item 2: blocks of 4 sampled next to blocks of 8, 2 and 16 draw the same numbers as alone."""
    model = tiny_model()
    alone = Engine(model, EngineConfig(max_num_seqs=8))
    r = alone.add_request(PROMPT, params)
    run_to_end(alone)
    shared = Engine(model, EngineConfig(max_num_seqs=8))
    for prompt, p in others:
        shared.add_request(prompt, p)
    r2 = shared.add_request(PROMPT, params)
    run_to_end(shared)
    assert r2.answer.tolist() == r.answer.tolist()
    assert r.answer.tolist() == generate(model, [PROMPT], params).answer_ids[0].tolist()


def test_seed_draws_depend_on_the_rows_own_width():
    """The unit rule: a row of width 4 in a step padded to 8 draws the numbers it draws alone."""
    from celeris.sampling.select import uniform

    def draws(width: int, padded: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(9)
        return uniform((1, padded, 3), [g], torch.device("cpu"), [width])[0, :width]

    assert torch.equal(draws(4, 4), draws(4, 8))


# ---------------------------------------------------------------- end-of-turn and stop ids (item 4)

EOT = 7


def eot_table(prompt_len: int, eot_at: int):
    """Answer position k predicts token 10 + k, except position ``eot_at``, which predicts EOT."""
    def table(position: int) -> torch.Tensor:
        logits = torch.zeros(64)
        k = position - prompt_len
        logits[EOT if k == eot_at else 10 + max(k, 0) % 40] = 10.0
        return logits
    return table


@pytest.mark.parametrize("params, expect_ids, reason", [
    (SamplingParams(max_tokens=8, steps=8, block_length=4), [10, 11, 12], "stop"),
    (SamplingParams(max_tokens=8, steps=8, block_length=4, ignore_eos=True), [10, 11, 12, EOT, 14, 15, 16, 17],
     "length"),
    (SamplingParams(max_tokens=8, steps=8, block_length=4, stop_token_ids=[11]), [10], "stop"),
    (SamplingParams(max_tokens=8, steps=8, block_length=4, ignore_eos=True, stop_token_ids=[15]),
     [10, 11, 12, EOT, 14], "stop"),
])
def test_generation_ends_at_every_end_id(scripted_model, params, expect_ids, reason):
    model = scripted_model(eot_table(len(PROMPT), eot_at=3))
    engine = Engine(model, EngineConfig(max_num_seqs=2), end_ids=[0, EOT])
    r = engine.add_request(PROMPT, params)
    run_to_end(engine)
    assert r.final_prefix() == expect_ids and r.finish_reason == reason
    if reason == "stop" and not params.ignore_eos:
        assert r.num_steps == 4  # early exit after the first block: the end-of-turn token ended it


def test_stop_token_ids_outside_the_vocabulary_are_refused():
    engine = Engine(tiny_model(), EngineConfig(max_num_seqs=2))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=4, stop_token_ids=[64]))
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])
