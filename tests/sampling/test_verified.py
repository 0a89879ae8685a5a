"""Verified decoding: exactly greedy next-token decoding at temperature 0 (batched, staggered, drafts
accepted and rolled back), the next-token distribution under speculative sampling, and its refusals."""

from __future__ import annotations

import pytest
import torch

from celeris.engine.verified import DraftRow, VerifiedDecoder, generate_verified
from celeris.reference.autoregressive import generate_autoregressive
from celeris.sampling.params import SamplingParams
from celeris.sampling.verified import accept_draft, check_verified_support, lookup_drafts
from tests.conftest import tiny_model

K = 3


@pytest.fixture(scope="module")
def hybrid():
    return tiny_model(seed=3, is_causal=True, draft_block_size=K)


def greedy(model, prompt, n):
    return generate_autoregressive(model, [prompt], SamplingParams(max_tokens=n, steps=n)).token_ids[0]


PROMPTS = [[5, 9, 11, 40], [7], [20, 21, 22, 23, 24, 25, 26, 27, 28], [33, 3, 60]]


def test_greedy_equals_next_token_decoding_batched(hybrid):
    """Rows of different prompt lengths and answer lengths in one batch: each equals its greedy answer."""
    lengths = [12, 20, 7, 16]
    params = [SamplingParams(max_tokens=n, steps=n, early_exit=False) for n in lengths]
    out = generate_verified(hybrid, PROMPTS, params)
    for prompt, n, got in zip(PROMPTS, lengths, out.token_ids, strict=True):
        assert got == greedy(hybrid, prompt, n)
    assert all(1 <= p <= len(t) for p, t in zip(out.row_passes, out.token_ids, strict=True))


class OracleDecoder(VerifiedDecoder):
    """Drafts the true greedy continuation, wrong at every fourth draft (k = 3, so each draft position is
    rejected in turn): drafts are accepted and rejected, so the rollback of rejected keys/values is exercised."""

    def __init__(self, model, answers, *a):
        super().__init__(model, *a)
        self.answers, self.calls = answers, 0

    def draft(self, row: DraftRow, slot_logits):
        truth = self.answers[tuple(row.prompt_ids)]
        nxt = len(row.answer)  # drafts are checked against the token at pending + 1: answer index len(answer)
        out = []
        for j in range(self.k):
            self.calls += 1
            tok = truth[nxt + j] if nxt + j < len(truth) else 0
            out.append(tok if self.calls % 4 else (tok + 1) % 64)  # not aligned with k: every position fails
        return out, []


def test_rejected_drafts_are_rolled_back_with_staggered_arrivals(hybrid):
    n = 24
    answers = {tuple(p): greedy(hybrid, p, n) for p in PROMPTS}
    dec = OracleDecoder(hybrid, answers, 4, 64)
    params = SamplingParams(max_tokens=n, steps=n, early_exit=False, decoding="verified", draft_source="slots")
    rows = [dec.add(PROMPTS[0], params), dec.add(PROMPTS[1], params)]
    steps = 0
    while not all(r.finished for r in rows) or len(rows) < len(PROMPTS):
        if steps in (2, 5) and len(rows) < len(PROMPTS):  # arrivals while others are mid-answer
            rows.append(dec.add(PROMPTS[len(rows)], params))
        for row, _ in dec.step():
            if row.finished:
                dec.remove(row)
        steps += 1
    for prompt, row in zip(PROMPTS, rows, strict=True):
        assert row.answer == answers[tuple(prompt)]
    assert sum(dec.accepted) > 0 and sum(dec.accepted) < sum(dec.drafted)  # both kinds happened
    assert all(0 < a < d for a, d in zip(dec.accepted, dec.drafted, strict=True))  # at every draft position
    assert sum(r.passes for r in rows) < len(PROMPTS) * n  # accepted drafts saved passes


def test_accept_draft_keeps_at_rate_min_one_p_over_q_else_returns_the_residual():
    """The one accept/residual step of verified decoding (with and without a grammar) against its definition
    (Leviathan et al., arXiv:2211.17192, Sec. 2.3): over 2,000 seeded calls per draft, a draft d is kept at rate
    min(1, p(d) / q(d)) (within 4 sigma), and every rejection returns norm(max(0, p - q)); with those two, kept
    drafts plus corrections are distributed exactly as p (checked as an identity)."""
    torch.manual_seed(0)
    p = torch.rand(6, dtype=torch.float64).softmax(0)
    q = torch.rand(6, dtype=torch.float64) ** 3
    q = q / q.sum()
    residual = (p - q).clamp(min=0)
    residual = residual / residual.sum()
    n = 2000
    for d in range(6):
        kept = 0
        for seed in range(n):
            out = accept_draft(p, q, d, torch.Generator().manual_seed(seed))
            if out is None:
                kept += 1
            else:
                assert torch.allclose(out, residual, rtol=0, atol=1e-15)
        rate = min(1.0, float(p[d] / q[d]))
        assert abs(kept / n - rate) <= 4 * (rate * (1 - rate) / n) ** 0.5 + 1e-12, d
    keep = torch.clamp(p / q, max=1.0)
    assert torch.allclose(q * keep + (q * (1 - keep)).sum() * residual, p)
    assert accept_draft(p, p, 0, torch.Generator().manual_seed(0)) is None  # p == q: always kept


@pytest.mark.slow  # 3.5 s each; the fast tier has test_accept_draft_keeps_at_rate_min_one_p_over_q_else_returns_the_residual
@pytest.mark.parametrize("penalty", [1.0, 2.0])
def test_speculative_sampling_keeps_the_next_token_distribution(hybrid, penalty):
    """The second answer token is the first one that comes from a draft. Its frequency over 3,000 seeded
    rows must match the exact marginal sum_t1 p(t1) p(t2 | t1) of the next-token head (total variation
    < 0.05, a bound about 3x the sampling noise here), while the drafts' own marginal is far from it; with a
    repetition penalty, p is the penalized head (CTRL's rule over the prompt and t1, written out here)."""
    prompt = [5, 9, 11, 40]
    n_rows = 3000
    params = [SamplingParams(max_tokens=2, steps=2, temperature=1.0, seed=s, early_exit=False, decoding="verified",
                             draft_source="slots", repetition_penalty=penalty)
              for s in range(n_rows)]
    dec = VerifiedDecoder(hybrid, n_rows, 16)
    rows = [dec.add(prompt, p) for p in params]
    while not all(r.finished for r in rows):
        dec.step()  # rows' whole answers, end-of-text included (a penalty makes it a likely first token)
    counts = torch.bincount(torch.tensor([r.answer[1] for r in rows]), minlength=64).double() / n_rows
    with torch.no_grad():
        banned = [hybrid.config.mask_token_id, hybrid.config.pad_token_id]

        def next_probs(ids):  # forward's row i scores token i (from the hidden state at i - 1): append a slot
            logits = hybrid(torch.tensor([ids + [0]]))[0, -1]
            for t in set(ids):
                logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
            logits[banned] = float("-inf")
            return logits.double().softmax(-1)

        p1 = next_probs(prompt)
        exact = sum(p1[t] * next_probs(prompt + [t]) for t in range(64) if p1[t] > 0)
    tv = 0.5 * float((counts - exact).abs().sum())
    assert tv < 0.05, tv
    assert 0 < sum(dec.accepted) < sum(dec.drafted)
    drafts_only = VerifiedDecoder(hybrid, 1, 16)  # what accepting every draft would give: the slots' marginal
    row = drafts_only.add(prompt, SamplingParams(max_tokens=2, steps=2))
    slot = drafts_only._run(0, 1, fresh=True)[0][0, len(prompt)].double().softmax(-1)
    q_marginal = slot / slot.sum()
    assert row.k == K and 0.5 * float((q_marginal - exact).abs().sum()) > 3 * tv


def test_refuses_models_and_settings_it_cannot_run(make_model, hybrid):
    with pytest.raises(ValueError, match="hybrid model"):
        check_verified_support(make_model(is_causal=True), SamplingParams())
    with pytest.raises(ValueError, match="causal model"):
        check_verified_support(make_model(draft_block_size=4), SamplingParams())  # not causal
    with pytest.raises(ValueError, match="cfg_scale"):
        check_verified_support(hybrid, SamplingParams(cfg_scale=1.0))
    with pytest.raises(ValueError, match="empty"):
        generate_verified(hybrid, [[]], SamplingParams())


def test_lookup_drafts_follow_the_last_earlier_occurrence():
    assert lookup_drafts([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], k=2) == [7, 8]  # the most recent match of [1, 2, 3]
    assert lookup_drafts([5, 6, 4, 4, 5, 6], k=4) == [4, 4, 5, 6]  # n = 2 when no 3-gram repeats
    assert lookup_drafts([1, 2, 3, 4], k=3) == []


@pytest.mark.parametrize("source", ["lookup", "lookup_first"])
def test_lookup_drafts_keep_the_greedy_answer(make_model, hybrid, source):
    """Prompt-lookup drafts (also for a plain causal model with no mask slots) change speed, not tokens;
    a repetitive prompt makes them accepted."""
    model = hybrid if source == "lookup_first" else make_model(seed=5, is_causal=True)
    prompt = [5, 9, 11, 40, 5, 9, 11, 40, 5, 9, 11, 40, 5, 9]
    params = SamplingParams(max_tokens=20, steps=20, early_exit=False, decoding="verified", draft_source=source)
    out = generate_verified(model, [prompt, PROMPTS[0]], params)
    assert out.token_ids == [greedy(model, prompt, 20), greedy(model, PROMPTS[0], 20)]
    assert sum(out.drafted) > 0
    with pytest.raises(ValueError, match="hybrid model"):
        generate_verified(make_model(is_causal=True), [prompt], SamplingParams(decoding="verified", draft_source="slots"))


def test_removing_a_row_while_new_rows_wait_for_their_prefill(hybrid):
    """The pool keeps prefilled rows first: removing one while a new row waits moves the new row behind them."""
    n = 10
    params = SamplingParams(max_tokens=n, steps=n, early_exit=False)
    dec = VerifiedDecoder(hybrid, 4, 64)
    first = [dec.add(PROMPTS[0], params), dec.add(PROMPTS[1], params), dec.add(PROMPTS[2], params)]
    dec.step()  # all three prefilled
    late = dec.add(PROMPTS[3], params)  # waits for its prefill
    dec.remove(first[0])  # the last row (the new one) moves into row 0, then behind the prefilled ones
    assert dec.rows.index(late) == dec.num_prefilled == 2
    rows = first[1:] + [late]
    while not all(r.finished for r in rows):
        dec.step()
    for prompt, row in zip(PROMPTS[1:], rows, strict=True):
        assert row.answer == greedy(hybrid, prompt, n)


def test_num_speculative_tokens_sets_the_drafts_per_pass_and_keeps_the_greedy_answer(make_model, hybrid,
                                                                                      monkeypatch):
    """vLLM's ``num_speculative_tokens``: k drafts per pass per row (rows of one batch may differ); the answer is
    still greedy's; mask-slot drafts are at most the trained draft block, prompt lookup may draft more."""
    n = 18
    rows = [SamplingParams(max_tokens=n, steps=n, early_exit=False, decoding="verified", num_speculative_tokens=k,
                           draft_source="slots") for k in (1, 2, K)]
    out = generate_verified(hybrid, PROMPTS[:3], rows)
    assert out.token_ids == [greedy(hybrid, p, n) for p in PROMPTS[:3]]
    for k in (1, 2):
        alone = generate_verified(hybrid, [PROMPTS[0]], rows[k - 1])
        assert sum(alone.drafted[:k]) > 0 and sum(alone.drafted[k:]) == 0  # no draft checked past position k
    repetitive = [5, 9, 11, 40, 2, 7] * 4
    model = make_model(seed=5, is_causal=True)
    params = SamplingParams(max_tokens=n, steps=n, early_exit=False, decoding="verified", draft_source="lookup",
                            num_speculative_tokens=8)
    from celeris.engine.proposers import lookup  # the prompt-lookup proposer looks its drafts up there

    asked = []
    monkeypatch.setattr(lookup, "lookup_drafts", lambda tokens, k: asked.append(k) or lookup_drafts(tokens, k))
    wide = generate_verified(model, [repetitive], params)
    assert wide.token_ids == [greedy(model, repetitive, n)] and set(asked) == {8}
    with pytest.raises(ValueError, match="num_speculative_tokens 4 exceeds the 3 mask slots"):
        check_verified_support(hybrid, SamplingParams(decoding="verified", draft_source="slots",
                                                      num_speculative_tokens=K + 1))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(decoding="verified", num_speculative_tokens=17)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(decoding="fixed", num_speculative_tokens=2)  # a setting of a rule not chosen


PENALTIES = {"repetition_penalty": [1.0, 1.5, 3.0], "frequency_penalty": [0.0, 0.5, 2.0],
             "presence_penalty": [0.0, 0.5, 2.0]}


@pytest.mark.parametrize("name", list(PENALTIES))
@pytest.mark.parametrize("source", ["slots", "lookup_first"])
def test_a_penalty_keeps_the_penalized_next_token_answer(hybrid, source, name):
    """CTRL's and OpenAI's penalties under verified decoding: each row (off, mild and strong in one batch) equals
    next-token decoding with its own penalty; drafts are accepted in runs (so positions after an accepted draft
    are penalized with that draft in their history), and the penalty changes the answers."""
    n = 24
    prompts = [[5, 9, 11, 40, 5, 9, 11, 40, 5, 9], PROMPTS[0], PROMPTS[2]]
    penalties = PENALTIES[name]
    params = [SamplingParams(max_tokens=n, steps=n, early_exit=False, decoding="verified", draft_source=source,
                             **{name: r}) for r in penalties]
    out = generate_verified(hybrid, prompts * 3, [p for p in params for _ in prompts])
    got = [out.token_ids[i : i + len(prompts)] for i in range(0, len(out.token_ids), len(prompts))]
    for r, answers in zip(penalties, got, strict=True):
        reference = generate_autoregressive(hybrid, prompts, SamplingParams(max_tokens=n, steps=n, early_exit=False,
                                                                             **{name: r}))
        assert answers == reference.token_ids, r
    assert got[0] != got[2]  # the penalty matters on these prompts
    assert out.accepted[1] > 0  # second drafts were accepted: their positions' context held the first


def test_penalize_along_equals_penalizing_each_position_with_its_own_history_bit_for_bit():
    """The penalties at the verify positions touch only the entries the drafts change; the slow reference gives every
    position its own full history (the row's tokens and the drafts before it) and penalizes whole rows."""
    from celeris.sampling.step import History, RowSettings, apply_penalties
    from celeris.sampling.verified import penalize_along

    torch.manual_seed(0)
    vocab, prompt, answer = 50, [3, 4, 5, 3], [7, 7, 9]
    logits = torch.randn(6, vocab) * 4
    for drafts in ([7, 2, 7, 7, 11], [1], [], [2, 3, 4, 5, 6]):
        for p in (SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25),
                  SamplingParams(frequency_penalty=0.2), SamplingParams(repetition_penalty=0.8)):
            settings = RowSettings.from_params([p], torch.device("cpu"))
            history = History.of(settings, [torch.tensor(prompt + answer)], [torch.tensor(answer)], vocab, 0,
                                 torch.device("cpu"))
            width = len(drafts) + 1
            expected = torch.stack([apply_penalties(logits[j][None, None], settings, History.of(
                settings, [torch.tensor(prompt + answer + drafts[:j])], [torch.tensor(answer + drafts[:j])], vocab, 0,
                torch.device("cpu")))[0, 0] for j in range(width)])
            before = logits.clone()
            got = penalize_along(logits[:width], history, drafts, settings)
            assert torch.equal(got, expected), (drafts, p)
            assert torch.equal(logits, before)  # the input is left as it is
