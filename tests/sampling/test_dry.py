"""DRY (``celeris.sampling.dry``): its penalties equal a brute-force reading of llama.cpp's rule, and next-token
decoding in the engine, verified decoding (prompt lookup and mask-slot drafts) and the slow reference decode the
same tokens with it; it applies only where the answer is decoded left to right."""

from __future__ import annotations

import random

import pytest

from celeris.config import EngineConfig
from celeris.engine import Engine
from celeris.engine.verified import generate_verified
from celeris.reference.autoregressive import generate_autoregressive
from celeris.sampling.dry import DrySettings, attach_vocabulary, breaker_ids, dry_penalties
from celeris.sampling.modes import check_request
from celeris.sampling.params import SamplingParams
from tests.conftest import tiny_model
from tests.engine.test_engine import run_to_end


def brute_force(tokens: list[int], dry: DrySettings) -> dict[int, float]:
    """llama.cpp's ``llama_sampler_dry_apply`` read literally: for every earlier end position j of the window, the
    longest suffix of the window that also ends at j (compared token by token), capped at the distance back to
    the last breaker; the token after j gets the longest such repeat it would extend."""
    window = tokens if dry.last_n < 0 else tokens[-dry.last_n :] if dry.last_n else []
    n = len(window)
    if n <= dry.allowed_length:
        return {}
    limit = n
    for i in range(n):  # i tokens back from the end
        if window[n - 1 - i] in dry.breakers:
            limit = i
            break
    if limit < dry.allowed_length:
        return {}
    longest: dict[int, int] = {}
    for j in range(n - 1):
        length = 0
        while length <= j and window[j - length] == window[n - 1 - length]:
            length += 1
        length = min(length, limit)
        if length >= dry.allowed_length:
            longest[window[j + 1]] = max(longest.get(window[j + 1], 0), length)
    top = dry.max_exponent
    return {t: dry.multiplier * dry.base ** (min(m - dry.allowed_length, top) if top else m - dry.allowed_length)
            for t, m in longest.items() if t not in dry.breakers}


def test_llama_cpps_worked_example():
    """The example of llama.cpp's comments: after a b c c b c y a b c, 'c' would extend a b c (3 tokens) and 'y'
    b c (2); 'b' would extend c (1 token, under the allowed length 2)."""
    a, b, c, y = 1, 2, 3, 9
    dry = DrySettings(multiplier=0.8, base=1.75, allowed_length=2, last_n=-1)
    assert dry_penalties([a, b, c, c, b, c, y, a, b, c], dry) == pytest.approx({c: 0.8 * 1.75, y: 0.8})


@pytest.mark.parametrize("seed", range(6))
def test_penalties_equal_the_brute_force_rule(seed):
    """Random contexts over small vocabularies (so that repeats are long and frequent, loops included), every
    setting varied: breakers, windows, allowed lengths, a base of 1 (no clamp) and a base whose clamp binds."""
    rng = random.Random(seed)
    for _ in range(60):
        vocab = rng.choice([2, 3, 5, 8])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 120))]
        if rng.random() < 0.3:  # a loop
            period = tokens[: rng.randrange(1, 5)] or [0]
            tokens = tokens + period * rng.randrange(5, 40)
        dry = DrySettings(multiplier=rng.choice([0.5, 0.8, 2.0]), base=rng.choice([1.0, 1.75, 3.0, 1e6]),
                          allowed_length=rng.randrange(0, 4), last_n=rng.choice([-1, 1, 7, 50]),
                          breakers=frozenset(rng.sample(range(vocab), rng.randrange(0, 2))))
        assert dry_penalties(tokens, dry) == pytest.approx(brute_force(tokens, dry)), (tokens, dry)


def test_breakers_are_the_tokens_whose_text_holds_a_breaker_string():
    class Model:
        pass

    model = Model()
    assert breaker_ids(model, ("\n",)) == frozenset()  # no vocabulary: no breakers
    calls = []
    attach_vocabulary(model, lambda: calls.append(1) or ["a", "b\n", "c:", "::", "\n\n", "d"])
    assert breaker_ids(model, ("\n", ":", "")) == frozenset({1, 2, 3, 4})
    assert breaker_ids(model, (":",)) == frozenset({2, 3}) and len(calls) == 1  # the texts are read once


@pytest.fixture(scope="module")
def hybrid():
    return tiny_model(seed=3, is_causal=True, draft_block_size=3)


PROMPTS = [[5, 9, 11, 40, 5, 9, 11, 40, 5, 9], [7], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
N = 40


def dry(**overrides: object) -> SamplingParams:
    return SamplingParams(max_tokens=N, steps=N, block_length=1, early_exit=False,
                          **{"dry_multiplier": 0.8, "dry_allowed_length": 1} | overrides)


def test_dry_changes_the_answer_of_a_looping_model(hybrid):
    """The tiny model repeats itself; DRY makes its answers repeat less (more distinct bigrams) and differ."""
    plain = generate_autoregressive(hybrid, PROMPTS, SamplingParams(max_tokens=N, steps=N, early_exit=False))
    penalized = generate_autoregressive(hybrid, PROMPTS, dry())

    def distinct(answers: list[list[int]]) -> int:
        return sum(len(set(zip(a, a[1:], strict=False))) for a in answers)

    assert penalized.token_ids != plain.token_ids
    assert distinct(penalized.token_ids) > distinct(plain.token_ids)


@pytest.mark.parametrize("extra", [{}, {"frequency_penalty": 0.5}, {"repetition_penalty": 1.5},
                                   {"temperature": 0.8, "top_p": 0.9, "seed": 11}],
                         ids=["dry", "dry+frequency", "dry+repetition", "dry-sampled"])
def test_next_token_decoding_in_the_engine_equals_the_reference(hybrid, extra):
    params = dry(cache="delayed", **extra)
    reference = generate_autoregressive(hybrid, PROMPTS, params, use_cache=False).token_ids
    engine = Engine(hybrid, EngineConfig(max_num_seqs=3, max_model_len=96))
    requests = [engine.add_request(p, params) for p in PROMPTS]
    run_to_end(engine)
    eos = hybrid.config.eos_token_id
    assert [r.final_prefix(eos) for r in requests] == reference


@pytest.mark.parametrize("source", ["slots", "lookup", "lookup_first"])
@pytest.mark.parametrize("extra", [{}, {"frequency_penalty": 0.5}], ids=["dry", "dry+frequency"])
def test_verified_decoding_keeps_the_next_token_answer(hybrid, source, extra):
    """Each verify position is penalized after its own context (the drafts before it): the verified answer is
    the next-token one, with drafts accepted along the way."""
    reference = generate_autoregressive(hybrid, PROMPTS, dry(**extra)).token_ids
    out = generate_verified(hybrid, PROMPTS, dry(decoding="verified", draft_source=source, **extra))
    assert out.token_ids == reference
    assert sum(out.accepted) > 0


def test_dry_is_refused_where_the_answer_is_not_decoded_left_to_right(make_model):
    diffusion = make_model(seed=1)
    with pytest.raises(ValueError, match="^dry_multiplier"):
        check_request(diffusion, SamplingParams(max_tokens=8, steps=8, dry_multiplier=0.8))
    with pytest.raises(ValueError, match="dry_multiplier"):
        SamplingParams(dry_multiplier=-1.0)
