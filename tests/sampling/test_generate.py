"""The vectorised sampler against a slow loop-based reference, batching, seeds, end-of-text, CFG.

``reference_generate`` below follows LLaDA's ``generate`` (arXiv:2502.09992, App. B) one row,
one block and one step at a time with plain Python loops, plus the two documented Celeris
differences: the mask and pad ids are never predicted, and blocks/steps that do not divide
evenly follow ``celeris.sampling.schedule.block_plan`` (ceil(max_new / block) blocks, the last
one shorter; ceil(steps / num_blocks) steps per block, clamped to [1, block size]).
"""

from __future__ import annotations

import math

import pytest
import torch

from celeris.reference.masked import generate
from celeris.sampling.params import SamplingParams
from tests.conftest import tiny_model


def reference_generate(model, prompt, max_tokens, steps, block_length, suffix=()):
    """Greedy (temperature 0) low-confidence remasking for ONE row; returns the answer's token ids."""
    cfg = model.config
    x = list(prompt) + [cfg.mask_token_id] * max_tokens + list(suffix)
    start0 = len(prompt)
    block_length = min(block_length, max_tokens)
    num_blocks = math.ceil(max_tokens / block_length)
    steps_per_block = max(1, math.ceil(steps / num_blocks))
    nfe = 0
    for blk in range(num_blocks):
        start = start0 + blk * block_length
        end = start0 + min((blk + 1) * block_length, max_tokens)
        block_steps = min(steps_per_block, end - start)
        num_masked = sum(1 for pos in range(start, end) if x[pos] == cfg.mask_token_id)
        # linear schedule: spread evenly, remainder to the first steps
        schedule = [num_masked // block_steps + (1 if i < num_masked % block_steps else 0) for i in range(block_steps)]
        for i in range(block_steps):
            with torch.no_grad():
                logits = model(torch.tensor([x]))[0]  # (T, V), no padding, no slicing
            nfe += 1
            candidates = []
            for pos in range(start, end):
                if x[pos] != cfg.mask_token_id:
                    continue
                row = logits[pos].clone()
                row[cfg.mask_token_id] = float("-inf")
                row[cfg.pad_token_id] = float("-inf")
                token = int(row.argmax())
                confidence = float(row.softmax(-1)[token])  # probability of the predicted token
                candidates.append((confidence, pos, token))
            candidates.sort(key=lambda c: -c[0])  # stable: the earlier position wins a tie
            for _, pos, token in candidates[: schedule[i]]:
                x[pos] = token
    assert cfg.mask_token_id not in x[start0 : start0 + max_tokens]
    return x[start0 : start0 + max_tokens], nfe


PROMPTS = [[5, 9, 17, 33, 4], [40, 41], [12, 60, 3, 8, 22, 19, 7, 50, 11]]


@pytest.mark.parametrize(
    ("max_new", "steps", "block"),
    [
        (16, 16, 8),  # even
        (16, 8, 8),  # two tokens per step
        (13, 7, 5),  # max_new not a multiple of block, steps not divisible by 3 blocks
        (10, 20, 4),  # more steps than tokens: clamped to the block size
        (12, 2, 4),  # fewer steps than blocks: one step per block
        (9, 5, 32),  # block capped at max_new; 5 steps for 9 tokens: 2, 2, 2, 2, 1
    ],
)
def test_matches_loop_reference(model, max_new, steps, block):
    params = SamplingParams(max_tokens=max_new, steps=steps, block_length=block, temperature=0.0,
                            early_exit=False)
    out = generate(model, PROMPTS, params)
    assert out.answer_ids.shape == (len(PROMPTS), max_new)
    for i, prompt in enumerate(PROMPTS):
        expected, ref_nfe = reference_generate(model, prompt, max_new, steps, block)
        assert out.answer_ids[i].tolist() == expected, f"row {i}"
        assert out.nfe == ref_nfe
    eos = model.config.eos_token_id
    for row, ids in zip(out.answer_ids.tolist(), out.token_ids, strict=True):
        assert ids == (row[: row.index(eos)] if eos in row else row)


def test_matches_loop_reference_with_suffix(model):
    params = SamplingParams(max_tokens=11, steps=6, block_length=4, early_exit=False)
    suffixes = [[20, 21, 22], [], [30]]
    out = generate(model, PROMPTS, params, suffix_ids=suffixes)
    for i, (prompt, suffix) in enumerate(zip(PROMPTS, suffixes, strict=True)):
        expected, _ = reference_generate(model, prompt, 11, 6, 4, suffix)
        assert out.answer_ids[i].tolist() == expected


def test_never_predicts_mask_or_pad(model):
    out = generate(model, PROMPTS, SamplingParams(max_tokens=24, steps=12, block_length=8, early_exit=False))
    assert not torch.isin(out.answer_ids, torch.tensor([model.config.mask_token_id, model.config.pad_token_id])).any()


# ---------------------------------------------------------------------------------------------
# Batched == alone


@pytest.mark.parametrize("decoding", ["fixed", "threshold", "entropy"])
def test_batched_equals_alone_greedy(model, decoding):
    own = {"threshold": {"threshold": 0.5}, "entropy": {"entropy_bound": 1.0}}.get(decoding, {})  # its rule's own
    params = SamplingParams(max_tokens=12, steps=6, block_length=5, decoding=decoding, **own, early_exit=False)
    batched = generate(model, PROMPTS, params)
    for i, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], params)
        assert batched.answer_ids[i].tolist() == alone.answer_ids[0].tolist(), f"row {i}"


def test_batched_equals_alone_with_suffix(model):
    params = SamplingParams(max_tokens=9, steps=9, block_length=4, early_exit=False)
    suffixes = [[20, 21, 22, 23], [30], []]
    batched = generate(model, PROMPTS, params, suffix_ids=suffixes)
    for i, (prompt, suffix) in enumerate(zip(PROMPTS, suffixes, strict=True)):
        alone = generate(model, [prompt], params, suffix_ids=[suffix])
        assert batched.answer_ids[i].tolist() == alone.answer_ids[0].tolist(), f"row {i}"
    # the suffix is really read: a different suffix changes the infill
    other = generate(model, [PROMPTS[0]], params, suffix_ids=[[50, 51, 52, 53]])
    assert other.answer_ids[0].tolist() != batched.answer_ids[0].tolist()


# ---------------------------------------------------------------------------------------------
# Seeds


@pytest.fixture(scope="module")
def flat_model():
    """Small init, so the predictive distributions are nearly uniform and sampling is really random."""
    torch.manual_seed(1)

    m = tiny_model(seed=1)
    m.init_weights(std=0.02)
    return m


def sampled(model, prompts, **kw):
    base = {"max_tokens": 16, "steps": 8, "block_length": 8, "temperature": 1.0, "early_exit": False}
    params = kw.pop("params", None)
    if params is None:
        params = SamplingParams(**{**base, **kw})
    return generate(model, prompts, params).answer_ids


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_same_seed_same_tokens_and_different_seeds_differ(flat_model, remasking):
    a = sampled(flat_model, [PROMPTS[0]], seed=123, remasking=remasking)
    b = sampled(flat_model, [PROMPTS[0]], seed=123, remasking=remasking)
    c = sampled(flat_model, [PROMPTS[0]], seed=124, remasking=remasking)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_min_p_one_keeps_only_the_top_token_so_sampling_is_greedy(flat_model):
    greedy = sampled(flat_model, [PROMPTS[0]], temperature=0.0)
    assert torch.equal(sampled(flat_model, [PROMPTS[0]], seed=5, min_p=1.0), greedy)
    assert not torch.equal(sampled(flat_model, [PROMPTS[0]], seed=5), greedy)  # min_p off: a real sample


def test_unseeded_requests_differ(flat_model):
    a = sampled(flat_model, [PROMPTS[0]], seed=None, max_tokens=24)
    b = sampled(flat_model, [PROMPTS[0]], seed=None, max_tokens=24)
    assert not torch.equal(a, b)


def test_seeded_row_same_alone_and_batched(flat_model):
    base = {"max_tokens": 16, "steps": 8, "block_length": 8, "early_exit": False}
    rows = [
        SamplingParams(**base, temperature=1.0, seed=7),
        SamplingParams(**base, temperature=0.7, top_p=0.9, seed=8),
        SamplingParams(**base, temperature=0.0, seed=9),
    ]
    batched = generate(flat_model, PROMPTS, rows).answer_ids
    for i, (prompt, p) in enumerate(zip(PROMPTS, rows, strict=True)):
        alone = generate(flat_model, [prompt], p).answer_ids
        assert batched[i].tolist() == alone[0].tolist(), f"row {i}"


def test_random_remasking_seeded_row_same_alone_and_batched(model):
    """A greedy row with random remasking must not depend on whether a sampled row shares its batch."""
    base = {"max_tokens": 16, "steps": 16, "block_length": 8, "early_exit": False, "remasking": "random"}
    rows = [SamplingParams(**base, temperature=0.0, seed=11), SamplingParams(**base, temperature=1.0, seed=12)]
    batched = generate(model, PROMPTS[:2], rows).answer_ids
    for i in range(2):
        alone = generate(model, [PROMPTS[i]], rows[i]).answer_ids
        assert batched[i].tolist() == alone[0].tolist(), f"row {i}"


def test_test_model_is_order_sensitive(model):
    """Guard: the tiny model's answers depend on context and commit order, so the equality tests
    above would notice a sampler that commits the wrong positions."""
    base = {"max_tokens": 16, "steps": 16, "block_length": 8, "early_exit": False}
    greedy = generate(model, PROMPTS, SamplingParams(**base)).answer_ids
    assert all(len(set(row)) >= 4 for row in greedy.tolist())
    orders = {tuple(generate(model, PROMPTS[:1], SamplingParams(**base, remasking="random", seed=s)).answer_ids[0].tolist())
              for s in range(4)}
    assert len(orders) >= 3


def test_temperature_zero_ignores_seed(model):
    a = sampled(model, [PROMPTS[1]], temperature=0.0, seed=1)
    b = sampled(model, [PROMPTS[1]], temperature=0.0, seed=2)
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# End of text and early exit


def eos_table(eos_position: int, vocab: int = 64, eos_id: int = 0):
    """Logits scripted by real position: EOS (very confident) at ``eos_position``; elsewhere a
    token that depends on the position, with confidence falling slowly along the sequence."""

    def table(pos: int) -> torch.Tensor:
        row = torch.zeros(vocab)
        if pos == eos_position:
            row[eos_id] = 20.0
        else:
            row[3 + pos % (vocab - 3)] = 5.0 - 0.01 * pos
        return row

    return table


def test_nothing_after_first_eos_is_returned(scripted_model):
    prompt = [5, 6, 7, 8]
    m = scripted_model(eos_table(eos_position=len(prompt) + 5))
    out = generate(m, [prompt], SamplingParams(max_tokens=16, steps=16, block_length=8, early_exit=False))
    answer = out.answer_ids[0].tolist()
    assert answer[5] == 0  # the EOS was committed ...
    assert answer[6:] != [] and 0 not in answer[6:]  # ... and the canvas goes on after it
    assert out.token_ids[0] == answer[:5]
    assert 0 not in out.token_ids[0]


def test_eos_cut_per_row_in_a_batch(scripted_model):
    prompts = [[5, 6, 7, 8], [9, 10]]  # same real EOS position -> answer positions 5 and 7
    m = scripted_model(eos_table(eos_position=9))
    out = generate(m, prompts, SamplingParams(max_tokens=12, steps=12, block_length=4, early_exit=False))
    assert [len(ids) for ids in out.token_ids] == [5, 7]
    assert all(0 not in ids for ids in out.token_ids)


@pytest.mark.parametrize("eos_answer_pos", [5, 12])
def test_early_exit_same_tokens_fewer_nfe(scripted_model, eos_answer_pos):
    prompt = [5, 6, 7, 8]
    m = scripted_model(eos_table(eos_position=len(prompt) + eos_answer_pos))
    base = {"max_tokens": 32, "steps": 32, "block_length": 8}
    full = generate(m, [prompt], SamplingParams(**base, early_exit=False))
    early = generate(m, [prompt], SamplingParams(**base, early_exit=True))
    assert early.token_ids == full.token_ids
    assert len(early.token_ids[0]) == eos_answer_pos
    assert full.nfe == 32
    blocks_needed = eos_answer_pos // 8 + 1
    assert early.nfe == 8 * blocks_needed < full.nfe
    # positions after the finished blocks were never denoised
    assert (early.answer_ids[0, 8 * blocks_needed :] == m.config.mask_token_id).all()


def test_early_exit_waits_for_every_row(scripted_model):
    prompts = [list(range(5, 13)), [9]]  # EOS at real position 14: answer position 6 (block 0) and 13 (block 1)
    m = scripted_model(eos_table(eos_position=14))
    base = {"max_tokens": 32, "steps": 32, "block_length": 8}
    full = generate(m, prompts, SamplingParams(**base, early_exit=False))
    early = generate(m, prompts, SamplingParams(**base, early_exit=True))
    assert early.token_ids == full.token_ids
    assert [len(t) for t in early.token_ids] == [6, 13]
    assert early.nfe == 16  # row 0 is done after block 0 but row 1 needs block 1: both run two blocks


def test_early_exit_on_real_model_keeps_tokens(model):
    """On a random model EOS may or may not appear; either way early exit must not change the answer."""
    base = {"max_tokens": 24, "steps": 24, "block_length": 4}
    full = generate(model, PROMPTS, SamplingParams(**base, early_exit=False))
    early = generate(model, PROMPTS, SamplingParams(**base, early_exit=True))
    assert early.token_ids == full.token_ids
    assert early.nfe <= full.nfe


# ---------------------------------------------------------------------------------------------
# Decoding rules through the sampler


def test_on_step_sees_monotone_commits(model):
    seen: list[torch.Tensor] = []
    params = SamplingParams(max_tokens=10, steps=5, block_length=4, early_exit=False)
    out = generate(model, PROMPTS[:2], params, on_step=lambda a: seen.append(a.clone()))
    mask_id = model.config.mask_token_id
    assert len(seen) == out.steps == out.nfe
    assert seen[0].shape == (2, 10)
    for before, after in zip(seen, seen[1:], strict=False):
        committed = before != mask_id
        assert torch.equal(after[committed], before[committed])  # committed tokens never change
        assert (after != mask_id).sum() > committed.sum()  # every step makes progress
    assert torch.equal(seen[-1], out.answer_ids)


@pytest.mark.parametrize(
    ("overrides", "expected_nfe"),
    [
        ({"decoding": "threshold", "threshold": 1.0}, 12),  # nothing is > 1: one token per step
        ({"decoding": "threshold", "threshold": 1e-9}, 3),  # everything above: one step per block
        ({"decoding": "factor", "factor": 1000.0}, 3),
        ({"decoding": "entropy", "entropy_bound": 0.0}, 12),
        ({"decoding": "entropy", "entropy_bound": 1e9}, 3),
        ({"decoding": "fixed", "steps": 6}, 6),
    ],
)
def test_decoding_rules_set_the_pace(model, overrides, expected_nfe):
    params = SamplingParams(**{"max_tokens": 12, "steps": 12, "block_length": 4, "early_exit": False,
                               **overrides})
    out = generate(model, PROMPTS, params)
    assert out.nfe == expected_nfe
    assert not (out.answer_ids == model.config.mask_token_id).any()


def test_temperature_zero_threshold_equals_fixed_tokens_when_one_per_step(model):
    """With one commit per step both rules take the single most confident prediction."""
    a = generate(model, PROMPTS, SamplingParams(max_tokens=8, steps=8, block_length=4, early_exit=False))
    b = generate(model, PROMPTS, SamplingParams(max_tokens=8, steps=8, block_length=4, early_exit=False,
                                                decoding="threshold", threshold=1.0))
    assert torch.equal(a.answer_ids, b.answer_ids)


# ---------------------------------------------------------------------------------------------
# Classifier-free guidance

A, B, C = 3, 4, 5


def cfg_tables():
    """cond c and uncond u logits such that argmax(u + (s + 1)(c - u)) is A at s=0, B at s=0.5 and 1,
    and C at s=3: A: u=2, c=2; B: u=0, c=1.5; C: u=-7, c=-3.5; every other token -10."""

    def make(values):
        def table(pos):
            row = torch.full((64,), -10.0)
            for tok, v in values.items():
                row[tok] = v
            return row

        return table

    return make({A: 2.0, B: 1.5, C: -3.5}), make({A: 2.0, B: 0.0, C: -7.0})


@pytest.mark.parametrize(("scale", "token"), [(0.0, A), (0.5, B), (1.0, B), (3.0, C)])
def test_cfg_formula(scripted_model, scale, token):
    cond, uncond = cfg_tables()
    m = scripted_model(cond, uncond_table=uncond)
    params = SamplingParams(max_tokens=4, steps=4, block_length=4, cfg_scale=scale, early_exit=False)
    out = generate(m, [[7, 8, 9]], params, suffix_ids=[[10, 11]])
    assert out.answer_ids[0].tolist() == [token] * 4
    assert out.nfe == (8 if scale > 0 else 4)
    if scale > 0:
        uncond_calls = [c for c in m.calls if int(c[0, 0]) == m.config.mask_token_id]
        assert len(uncond_calls) == 4
        for call in uncond_calls:  # prompt and suffix hidden, the answer canvas kept
            assert call[0, :3].tolist() == [m.config.mask_token_id] * 3
            assert call[0, -2:].tolist() == [m.config.mask_token_id] * 2


def test_cfg_scale_per_row(scripted_model):
    cond, uncond = cfg_tables()
    m = scripted_model(cond, uncond_table=uncond)
    base = {"max_tokens": 4, "steps": 4, "block_length": 4, "early_exit": False}
    rows = [SamplingParams(**base, cfg_scale=0.0), SamplingParams(**base, cfg_scale=3.0)]
    with pytest.raises(ValueError):  # cfg on/off changes the number of passes: not batchable
        generate(m, [[7, 8], [7, 8]], rows)
    rows = [SamplingParams(**base, cfg_scale=1.0), SamplingParams(**base, cfg_scale=3.0)]
    out = generate(m, [[7, 8], [7, 8, 9]], rows)
    assert out.answer_ids.tolist() == [[B] * 4, [C] * 4]


def test_cfg_doubles_nfe_on_real_model(model):
    base = {"max_tokens": 8, "steps": 8, "block_length": 4, "early_exit": False}
    plain = generate(model, PROMPTS, SamplingParams(**base))
    guided = generate(model, PROMPTS, SamplingParams(**base, cfg_scale=2.0))
    assert guided.nfe == 2 * plain.nfe == 16
    assert guided.steps == plain.steps == 8


# ---------------------------------------------------------------------------------------------
# Bad input


def test_rejects_bad_calls(model):
    p = SamplingParams(max_tokens=4, steps=4)
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[5], []], p)
    with pytest.raises(ValueError):
        generate(model, [], p)
    with pytest.raises(ValueError):
        generate(model, [[5], [6]], [p])
    with pytest.raises(ValueError, match="max_tokens"):
        generate(model, [[5], [6]], [p, SamplingParams(max_tokens=5, steps=4)])


def record_windows(model: torch.nn.Module, monkeypatch) -> list[object]:
    """The ``window`` argument of every forward pass of ``model`` from now on (None: a full pass)."""
    calls: list[object] = []
    forward = model.forward

    def spy(*args, **kwargs):
        calls.append(kwargs.get("window"))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    return calls


@pytest.mark.parametrize("cache, refresh, full_passes", [("none", 0, 12), ("prefix", 0, 3), ("dual", 0, 3),
                                                          ("delayed", 0, 1), ("delayed", 2, 2), ("delayed", 1, 3),
                                                          ("dual_delayed", 0, 1), ("dual_delayed", 2, 2)])
def test_cache_modes_make_the_documented_passes(cache, refresh, full_passes, monkeypatch):
    """none: every step is a full pass; prefix/dual: one per block; delayed: only the prefill, then the
    block, plus at a block's first step the column committed at the previous block's last step;
    dual_delayed: the same, but a block's first step runs from the previous block's start to the end; with
    cache_refresh k also a full pass at the first step of every k-th block (blocks 0 and 2 for k = 2)."""
    model = tiny_model()
    calls = record_windows(model, monkeypatch)
    prompt = [5, 6, 7, 8]
    frames: list[torch.Tensor] = []
    out = generate(model, [prompt], SamplingParams(max_tokens=12, steps=12, block_length=4, cache=cache,
                                                   cache_refresh=refresh if cache.endswith("delayed") else None,
                                                   early_exit=False),
                   on_step=lambda a: frames.append(a.clone()))
    assert len(calls) == 12 and sum(w is None for w in calls) == full_passes
    if refresh:
        assert [i for i, w in enumerate(calls) if w is None] == list(range(0, 12, 4 * refresh))
    if cache == "delayed" and refresh != 1:
        lp = len(prompt)
        assert calls[1:4] == [(lp, lp + 4)] * 3
        stale = calls[4]  # block 1's first step: one stale column of block 0, then block 1
        assert isinstance(stale, torch.Tensor) and stale.shape == (1, 5)
        filled_last = ((frames[3] != frames[2])[0]).nonzero().flatten().tolist()  # block 0's last step
        assert [int(stale[0, 0]) - lp] == filled_last and stale[0, 1:].tolist() == list(range(lp + 4, lp + 8))
        assert out.answer_ids.shape == (1, 12)
    if cache == "dual_delayed":
        lp = len(prompt)
        assert calls[1:4] == [(lp, lp + 4)] * 3 and calls[5:8] == [(lp + 4, lp + 8)] * 3
        assert calls[4] == (lp, lp + 12)  # block 1's first step: block 0 (final tokens) to the end
        assert calls[8] == (None if refresh == 2 else (lp + 4, lp + 12))


class CutCanvas(torch.nn.Module):
    """The obvious suffix window: every pass gets the canvas *cut* W columns after its scored block."""

    def __init__(self, model: torch.nn.Module, window: int) -> None:
        super().__init__()
        self.model, self.window, self.config = model, window, model.config

    def forward(self, input_ids, attention_mask=None, logits_slice=None, **kwargs):
        cut = min(input_ids.shape[1], logits_slice.stop + self.window)
        mask = None if attention_mask is None else attention_mask[:, :cut]
        return self.model(input_ids[:, :cut], mask, logits_slice=logits_slice, **kwargs)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_suffix_window_equals_cutting_the_canvas(window):
    """suffix_window W (masking the far suffix out of attention) gives the tokens of passes on the canvas cut
    W columns past the block; a window covering the whole answer changes nothing."""
    model = tiny_model()
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    params = SamplingParams(max_tokens=12, steps=12, block_length=4, early_exit=False, suffix_window=window)
    masked = generate(model, prompts, params)
    cut = generate(CutCanvas(model, window), prompts, SamplingParams(max_tokens=12, steps=12, block_length=4,
                                                                     early_exit=False))
    assert torch.equal(masked.answer_ids, cut.answer_ids)
    whole = SamplingParams(max_tokens=12, steps=12, block_length=4, early_exit=False)
    wide = SamplingParams(max_tokens=12, steps=12, block_length=4, early_exit=False, suffix_window=12)
    assert torch.equal(generate(model, prompts, wide).answer_ids, generate(model, prompts, whole).answer_ids)


@pytest.mark.parametrize("cache", ["prefix", "dual", "dual_delayed"])
def test_suffix_window_with_a_cache_stops_the_suffix_passes_at_the_window(cache, monkeypatch):
    """With W, a cached pass never computes past the block's end + W; with one step per block the cache
    gives the uncached tokens (the prefix/dual caches are exact then)."""
    model = tiny_model()
    calls = record_windows(model, monkeypatch)
    prompt = [5, 6, 7, 8]
    lp = len(prompt)
    generate(model, [prompt], SamplingParams(max_tokens=12, steps=12, block_length=4, cache=cache,
                                             early_exit=False, suffix_window=2))
    assert len(calls) == 12  # one token per step: calls[i] denoises block i // 4, which ends at lp + 4 * (i // 4 + 1)
    spans = [(i, w) for i, w in enumerate(calls) if isinstance(w, tuple)]
    assert spans and all(w[1] <= lp + 4 * (i // 4 + 1) + 2 for i, w in spans)
    if cache == "dual_delayed":
        assert calls[4] == (lp, lp + 8 + 2)  # block 1's first step: block 0 through block 1 and 2 masked columns
    if cache == "prefix":
        assert calls[1] == (lp, lp + 4 + 2)
    one_step = SamplingParams(max_tokens=12, steps=3, block_length=4, early_exit=False, suffix_window=2)
    if cache in ("prefix", "dual"):
        with_cache = SamplingParams(max_tokens=12, steps=3, block_length=4, early_exit=False, suffix_window=2,
                                    cache=cache)
        assert torch.equal(generate(model, [prompt], with_cache).answer_ids, generate(model, [prompt], one_step).answer_ids)


def test_suffix_window_refuses_infilling():
    params = SamplingParams(max_tokens=4, steps=4, block_length=4, suffix_window=2)
    with pytest.raises(ValueError, match="suffix_window cannot be used with a suffix"):
        generate(tiny_model(), [[5, 6]], params, suffix_ids=[[7, 8]])


@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "dual_delayed"])
def test_suffix_window_never_reads_a_key_computed_outside_the_window(cache, monkeypatch):
    """Columns past the window get no real RoPE position while masked (positions count attended columns);
    every cache mode must recompute them before they come into view, so giving them their true positions
    changes no token."""
    from celeris.models import layers

    model = tiny_model()
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    params = SamplingParams(max_tokens=12, steps=12, block_length=4, early_exit=False, cache=cache,
                            suffix_window=2, cfg_scale=1.0 if cache == "dual" else 0.0)
    windowed = generate(model, prompts, params).answer_ids

    def true_positions(input_ids, attention_mask):
        positions, key_mask = layers_positions(input_ids, attention_mask)
        if attention_mask is not None:  # count from the first real token, padding and window alike
            first = attention_mask.int().argmax(-1, keepdim=True)
            positions = (torch.arange(input_ids.shape[1])[None] - first).clamp(min=0)
        return positions, key_mask

    layers_positions = layers.positions_and_mask
    monkeypatch.setattr(layers, "positions_and_mask", true_positions)
    assert torch.equal(generate(model, prompts, params).answer_ids, windowed)
