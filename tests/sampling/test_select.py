"""Sampling, filters and confidences of celeris.sampling.select, checked on hand-made inputs and brute force
(the commit rules: tests/sampling/test_rules.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from celeris.sampling.select import (
    NEG_INF,
    low_confidence,
    margin_confidence,
    min_p_filter,
    neg_entropy_confidence,
    rank_desc,
    sample_tokens,
    top_k_filter,
    top_p_filter,
)


def conf_of(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_rank_desc():
    assert rank_desc(conf_of([[0.2, 0.9, 0.5]])).tolist() == [[2, 0, 1]]


def brute_force_nucleus(probs: list[float], top_p: float) -> set[int]:
    """The smallest set of tokens with mass >= top_p (ties broken towards more probable tokens)."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    for size in range(1, len(probs) + 1):
        if sum(probs[i] for i in order[:size]) >= top_p - 1e-12:
            return set(order[:size])
    return set(order)


@pytest.mark.parametrize(("top_p", "kept"), [(0.45, {0}), (0.75, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_minimal_nucleus(top_p, kept):
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()[None, None]  # (1, 1, 4)
    out = top_p_filter(logits, torch.tensor([top_p]))
    assert {i for i in range(4) if out[0, 0, i] > NEG_INF} == kept
    torch.testing.assert_close(out[0, 0, sorted(kept)], logits[0, 0, sorted(kept)])  # survivors unchanged


def test_top_p_matches_brute_force_per_row():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 12, generator=gen) * 2
    top_p = torch.tensor([0.3, 0.9, 1.0])
    out = top_p_filter(logits, top_p)
    for b, li in itertools.product(range(3), range(5)):
        probs = logits[b, li].softmax(-1).tolist()
        kept = {i for i in range(12) if out[b, li, i] > NEG_INF}
        expected = brute_force_nucleus(probs, float(top_p[b]))
        # minimal: same size as the brute-force nucleus, and it holds enough mass
        assert len(kept) == len(expected)
        assert sum(probs[i] for i in kept) >= float(top_p[b]) - 1e-6
        assert int(logits[b, li].argmax()) in kept


def test_sample_tokens_greedy_and_seeded():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 6, 10, generator=gen)
    greedy = sample_tokens(logits, torch.zeros(2), [torch.Generator().manual_seed(0)] * 2)
    assert torch.equal(greedy, logits.argmax(-1))
    a = sample_tokens(logits, torch.tensor([0.0, 1.0]), [torch.Generator().manual_seed(i) for i in (5, 6)])
    b = sample_tokens(logits, torch.tensor([0.0, 1.0]), [torch.Generator().manual_seed(i) for i in (5, 6)])
    assert torch.equal(a, b)
    assert torch.equal(a[0], logits[0].argmax(-1))  # a greedy row stays greedy inside a sampled batch


def test_sample_tokens_follows_softmax():
    """Gumbel-max draws follow softmax(logits / T): check frequencies on a 3-token distribution."""
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log()[None, None].expand(1, 4000, 3).contiguous()
    draws = sample_tokens(logits, torch.tensor([1.0]), [torch.Generator().manual_seed(0)])
    freq = torch.bincount(draws.flatten(), minlength=3).double() / draws.numel()
    torch.testing.assert_close(freq, probs.double(), atol=0.03, rtol=0)
    # a high temperature flattens the distribution
    hot = sample_tokens(logits, torch.tensor([100.0]), [torch.Generator().manual_seed(0)])
    assert (torch.bincount(hot.flatten(), minlength=3).double() / hot.numel()).min() > 0.28


def test_low_confidence_is_probability_of_prediction():
    probs = torch.tensor([[[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]])
    x0 = torch.tensor([[0, 1]])
    conf = low_confidence(probs, x0, [])
    assert conf.dtype == torch.float64
    torch.testing.assert_close(conf, torch.tensor([[0.7, 0.1]], dtype=torch.float64))


def test_repetition_penalty_matches_a_loop_and_moves_the_argmax():
    """CTRL penalty: seen tokens' positive logits divided by theta, negative ones multiplied; others unchanged."""
    from celeris.sampling.params import SamplingParams
    from celeris.sampling.step import History, RowSettings, context_tokens, denoise_step, penalize_repetition

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)
    seen = context_tokens([torch.tensor([1, 2, 5]), torch.tensor([4, 0])], 7, mask_id=0, device=torch.device("cpu"))
    assert seen.tolist() == [[c in (1, 2, 5) for c in range(7)], [c == 4 for c in range(7)]]  # mask id 0 excluded
    theta = torch.tensor([2.0, 1.5])[:, None, None]
    got = penalize_repetition(logits, seen, theta)
    for b, pos, v in itertools.product(range(2), range(3), range(7)):
        x, t = float(logits[b, pos, v]), float(theta[b, 0, 0])
        want = (x / t if x > 0 else x * t) if seen[b, v] else x
        assert abs(float(got[b, pos, v]) - want) < 1e-6
    # the repeated token 1 leads by a little; with theta 2 the unseen token 3 wins
    block_logits = torch.full((1, 1, 7), -5.0)
    block_logits[0, 0, 1], block_logits[0, 0, 3] = 4.0, 3.0
    block, mask_id = torch.tensor([[0]]), 0
    rows = [SamplingParams(repetition_penalty=2.0)]
    settings = RowSettings.from_params(rows, torch.device("cpu"))
    seen1 = History(seen=context_tokens([torch.tensor([1, 2])], 7, mask_id, torch.device("cpu")))
    new, _ = denoise_step(block_logits, block, mask_id, [mask_id], torch.tensor([1]), settings, [None], seen1)
    assert new.tolist() == [[3]]
    plain = RowSettings.from_params([SamplingParams()], torch.device("cpu"))
    new, _ = denoise_step(block_logits, block, mask_id, [mask_id], torch.tensor([1]), plain, [None], seen1)
    assert new.tolist() == [[1]]


def test_frequency_and_presence_penalties_match_a_loop_over_the_answer_only():
    """OpenAI's penalties: logit - frequency * count - presence * (count > 0), counts over the answer so far (not
    the prompt, not uncommitted mask positions), after CTRL's penalty over prompt and answer (vLLM's order)."""
    from celeris.sampling.params import SamplingParams
    from celeris.sampling.step import History, RowSettings, apply_penalties

    torch.manual_seed(1)
    logits = torch.randn(2, 3, 7)
    prompts = [[1, 2], [6]]
    answers = [torch.tensor([3, 3, 5, 0, 0]), torch.tensor([2, 0, 0, 0, 0])]  # mask id 0: not committed yet
    rows = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.5),
            SamplingParams(frequency_penalty=-1.0)]
    cpu = torch.device("cpu")
    settings = RowSettings.from_params(rows, cpu)
    history = History.of(settings, [torch.cat([torch.tensor(p), a]) for p, a in zip(prompts, answers, strict=True)],
                         answers, 7, 0, cpu)
    got = apply_penalties(logits, settings, history)
    for b, pos, v in itertools.product(range(2), range(3), range(7)):
        x, r = float(logits[b, pos, v]), rows[b]
        if v in prompts[b] or v in answers[b][answers[b] != 0].tolist():
            x = x / r.repetition_penalty if x > 0 else x * r.repetition_penalty
        count = answers[b].tolist().count(v) if v != 0 else 0
        x -= r.frequency_penalty * count + r.presence_penalty * (count > 0)
        assert abs(float(got[b, pos, v]) - x) < 1e-6, (b, pos, v)
    assert history.counts[0].tolist() == [0, 0, 0, 2, 0, 1, 0]  # the prompt's 1 and 2 not counted
    plain = RowSettings.from_params([SamplingParams()], cpu)
    assert History.of(plain, [torch.tensor([1])], [torch.tensor([2])], 7, 0, cpu) is None


# ---------------------------------------------------------------------------------------------
# Dream's remasking confidences and top-k (issue 16 item 4), against plain per-position loops


def random_probs(seed: int, shape=(2, 5, 7)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape, generator=g) * 3
    logits[0, 0, 2:] = float("-inf")  # a position with only two possible tokens: 0 log 0 terms
    logits[1, 1] = 0.0  # a flat position: margin 0, maximal entropy
    return logits.softmax(-1)


@pytest.mark.parametrize("seed", range(3))
def test_margin_is_top1_minus_top2_probability(seed):
    probs = random_probs(seed)
    got = margin_confidence(probs, probs.argmax(-1), [None] * 2)
    for b, i in itertools.product(range(probs.shape[0]), range(probs.shape[1])):
        ranked = sorted(probs[b, i].tolist(), reverse=True)
        assert got[b, i].item() == pytest.approx(ranked[0] - ranked[1], abs=1e-7)
    assert got.dtype == torch.float64 and got[1, 1].item() == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("seed", range(3))
def test_entropy_confidence_is_minus_the_entropy(seed):
    import math

    probs = random_probs(seed)
    got = neg_entropy_confidence(probs, probs.argmax(-1), [None] * 2)
    for b, i in itertools.product(range(probs.shape[0]), range(probs.shape[1])):
        want = sum(p * math.log(p) for p in probs[b, i].tolist() if p > 0)
        assert got[b, i].item() == pytest.approx(want, abs=1e-6)
    assert got[1, 1].item() == pytest.approx(-math.log(7), abs=1e-6)  # uniform over 7 tokens
    assert (got <= 1e-12).all()


def reference_top_k(row: list[float], k: int) -> list[float]:
    """Keep the values >= the k-th largest (ties kept, as Dream's ``top_k_logits``); k = 0 keeps all."""
    if k == 0 or k >= len(row):
        return row
    kth = sorted(row, reverse=True)[k - 1]
    return [v if v >= kth else float("-inf") for v in row]


@pytest.mark.parametrize("ks", [[0, 3], [1, 7], [2, 100], [5, 0]])
def test_top_k_filter_matches_a_loop(ks):
    g = torch.Generator().manual_seed(sum(ks))
    logits = torch.randn(2, 4, 7, generator=g)
    logits[0, 1, :3] = 2.0  # a three-way tie for the top
    logits[1, 2, 4:] = float("-inf")  # banned ids: fewer finite values than k
    got = top_k_filter(logits, torch.tensor(ks))
    for b, i in itertools.product(range(2), range(4)):
        assert got[b, i].tolist() == reference_top_k(logits[b, i].tolist(), ks[b]), (b, i)


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability():
    probs = torch.tensor([[[0.5, 0.3, 0.15, 0.05]], [[0.5, 0.3, 0.15, 0.05]]])
    logits = probs.log()
    kept = min_p_filter(logits, torch.tensor([0.5, 0.0])) > NEG_INF  # row 0: floor 0.25; row 1: off
    assert kept.tolist() == [[[True, True, False, False]], [[True, True, True, True]]]
    assert (min_p_filter(logits, torch.tensor([1.0, 1.0])) > NEG_INF).sum(-1).tolist() == [[1], [1]]  # the top stays
