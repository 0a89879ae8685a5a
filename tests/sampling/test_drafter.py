"""Verified decoding with a DFlash drafter: lossless against next-token decoding, the same tokens and acceptance
lengths as a plain re-implementation of the published ``dflash_generate`` loop, and drafters that do not fit
refused naming both sides."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from celeris.engine.verified import VerifiedDecoder, generate_verified
from celeris.models import kernels
from celeris.models.dflash import DFlashConfig, DFlashDraftModel
from celeris.reference.autoregressive import generate_autoregressive
from celeris.sampling.drafter import DFlashProposer, SpeculativeConfig, attach, check_drafter
from celeris.sampling.params import SamplingParams
from celeris.sampling.step import banned_token_ids
from celeris.sampling.verified import check_verified_support
from celeris.train.dflash import Row, batch_tensors, dflash_loss
from tests.conftest import tiny_model

BLOCK = 5  # the drafter's block: the last accepted token and 4 mask tokens (4 drafts per pass)
PROMPTS = [[5, 9, 11, 40], [7, 8], [20, 21, 22, 23, 24, 25, 26, 27, 28], [33, 3, 60]]


def drafter_for(target: torch.nn.Module, seed: int = 0, **overrides: object) -> DFlashDraftModel:
    """A random 1-layer drafter shaped for ``target`` (reading both of its layers)."""
    torch.manual_seed(seed)
    a = target.arch
    cfg = DFlashConfig(**{"hidden_size": a.hidden_size, "intermediate_size": 64, "num_hidden_layers": 1,
                          "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads,
                          "head_dim": a.head_dim, "vocab_size": target.config.vocab_size,
                          "num_target_layers": len(target.layers), "block_size": BLOCK,
                          "rope_theta": a.rope_theta, "mask_token_id": target.config.mask_token_id,
                          "target_layer_ids": [0, 1], **overrides})
    return DFlashDraftModel(cfg).eval()


def features(target: torch.nn.Module, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """The target's layer outputs at ``layer_ids`` for every position of ``ids``, causal, no cache: (L, n * d)."""
    x = torch.tensor([ids])
    n = len(ids)
    capture = dict.fromkeys(layer_ids)
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        target.layout_hidden_states(x, torch.arange(n)[None], causal, capture=capture)
    return torch.cat([capture[i] for i in layer_ids], -1)[0]


def greedy(target: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    return generate_autoregressive(target, [prompt], SamplingParams(max_tokens=n, steps=n)).token_ids[0]


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=5, is_causal=True)


@pytest.fixture(scope="module")
def trained(target):
    """A drafter trained for 300 steps with DFlash's objective on the target's own greedy continuations, so that it
    accepts often (and not always)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 64, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(48)]
    answers = generate_autoregressive(target, prompts, SamplingParams(max_tokens=20, steps=20, early_exit=False))
    drafter = drafter_for(target, seed=1)
    rows = []
    for p, a in zip(prompts, answers.token_ids, strict=True):
        ids = p + a
        rows.append(Row(torch.tensor(ids), len(p), features(target, ids, [0, 1])[:-1]))
    drafter.train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    embed = target.embed_tokens.weight.detach()
    for _ in range(300):
        batch = [rows[int(i)] for i in torch.randint(0, len(rows), (8,), generator=gen)]
        ids, labels, feats, anchors, valid = batch_tensors(batch, 4, BLOCK, target.config.mask_token_id, gen)
        lengths = torch.tensor([len(r.ids) for r in batch])
        loss, _ = dflash_loss(drafter, embed, ids, feats.float(), anchors, valid, lengths, 4.0, None, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


def published_loop(target, drafter, prompt: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """z-lab/dflash ``dflash_generate`` for one row, in plain code with no caches: every target pass recomputes the
    whole sequence, every drafter call the whole context. Returns (answer tokens, acceptance length per pass)."""
    cfg, layer_ids = drafter.config, drafter.config.target_layer_ids
    mask = cfg.mask_token_id
    with torch.no_grad():
        def target_logits(ids):  # (L, V): row c scores the token at c + 1; the target never emits mask or pad
            logits = target.logits(target.layout_hidden_states(
                torch.tensor([ids]), torch.arange(len(ids))[None],
                torch.ones(len(ids), len(ids), dtype=torch.bool).tril()[None, None]))[0]
            logits[:, banned_token_ids(target.config)] = float("-inf")
            return logits

        tokens = list(prompt) + [int(target_logits(prompt)[-1].argmax())]
        lengths = []
        while len(tokens) - len(prompt) < max_tokens:
            start = len(tokens) - 1  # the block starts at the last accepted token
            ctx = features(target, tokens[:start], layer_ids)  # (start, n * d): every accepted column
            block = torch.tensor([[tokens[start]] + [mask] * (cfg.block_size - 1)])
            hidden = drafter(F.embedding(block, target.embed_tokens.weight), ctx[None],
                             torch.arange(start + cfg.block_size)[None])[0]
            drafts = target.logits(hidden[1:]).argmax(-1).tolist()  # (block_size - 1,)
            posterior = target_logits(tokens + drafts)[start:].argmax(-1).tolist()  # the target at every block column
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == posterior[accepted]:
                accepted += 1
            tokens += drafts[:accepted] + [posterior[accepted]]
            lengths.append(accepted)
    return tokens[len(prompt):][:max_tokens], lengths


def celeris_run(target, drafter, prompts, max_tokens):
    """Celeris's batched verified decoding with ``drafter`` (rows arrive together, advance raggedly)."""
    dec = VerifiedDecoder(target, len(prompts), 64, proposer=DFlashProposer(drafter, target))
    params = SamplingParams(max_tokens=max_tokens, early_exit=False, decoding="verified", draft_source="dflash")
    rows = [dec.add(p, params) for p in prompts]
    while not all(r.finished for r in rows):
        dec.step()
    return rows, dec


def test_the_published_loop_gives_the_same_tokens_and_acceptance_lengths(target, trained):
    rows, dec = celeris_run(target, trained, PROMPTS, 24)
    seen = []
    for prompt, row in zip(PROMPTS, rows, strict=True):
        tokens, lengths = published_loop(target, trained, prompt, 24)
        assert row.answer[:24] == tokens
        assert row.acceptance_lengths == lengths[: len(row.acceptance_lengths)]
        seen += row.acceptance_lengths
    assert max(seen) >= 3 and min(seen) < BLOCK - 1  # the drafter accepts long runs and is also rejected
    assert dec.proposer.calls == sum(r.draft_state.calls for r in rows) > 0


def test_greedy_with_any_drafter_equals_next_token_decoding(target, trained):
    for drafter in (drafter_for(target, seed=2), trained):  # one that is almost always wrong, one that is not
        attach(target, DFlashProposer(drafter, target, num_speculative_tokens=3))
        try:
            params = SamplingParams(max_tokens=16, decoding="verified", draft_source="lookup_first", early_exit=False)
            out = generate_verified(target, PROMPTS, params)
        finally:
            attach(target, None)
        assert out.token_ids == [greedy(target, p, 16) for p in PROMPTS]
        assert len(out.drafted) == 3


def test_a_repetition_penalty_with_the_drafter_keeps_the_penalized_next_token_answer(target, trained):
    """The drafter's drafts, scored with the row's penalty, verified against the penalized target: each row equals
    next-token decoding with that penalty, and the drafter still has drafts accepted."""
    attach(target, DFlashProposer(trained, target))
    try:
        params = SamplingParams(max_tokens=20, decoding="verified", draft_source="dflash", early_exit=False,
                                repetition_penalty=1.8)
        out = generate_verified(target, PROMPTS, params)
    finally:
        attach(target, None)
    reference = generate_autoregressive(target, PROMPTS, SamplingParams(max_tokens=20, steps=20, early_exit=False,
                                                                         repetition_penalty=1.8))
    assert out.token_ids == reference.token_ids
    assert out.token_ids != [greedy(target, p, 20) for p in PROMPTS]  # the penalty changed the answers
    assert sum(out.accepted) > 0


@pytest.mark.slow
def test_speculative_sampling_with_one_hot_drafts_keeps_the_next_token_distribution(target, trained):
    """At temperature 1 the second answer token (the first a draft can give) follows the target's exact marginal
    sum_t1 p(t1) p(t2 | t1) over 2,000 seeded rows (total variation < 0.06, ~3x the sampling noise)."""
    prompt, n_rows = [5, 9, 11, 40], 2000
    params = [SamplingParams(max_tokens=2, temperature=1.0, seed=s, early_exit=False, decoding="verified",
                             draft_source="dflash") for s in range(n_rows)]
    attach(target, DFlashProposer(trained, target))
    try:
        out = generate_verified(target, [prompt] * n_rows, params)
    finally:
        attach(target, None)
    counts = torch.bincount(torch.tensor([t[1] for t in out.token_ids]), minlength=64).double() / n_rows
    banned = [target.config.mask_token_id, target.config.pad_token_id]

    def next_probs(ids):
        with torch.no_grad():
            logits = target(torch.tensor([ids + [0]]))[0, -1]
        logits[banned] = float("-inf")
        return logits.double().softmax(-1)

    p1 = next_probs(prompt)
    exact = sum(p1[t] * next_probs(prompt + [t]) for t in range(64) if p1[t] > 0)
    assert 0.5 * float((counts - exact).abs().sum()) < 0.06
    assert 0 < sum(out.accepted) < sum(out.drafted)


@pytest.mark.parametrize("override, words", [
    ({"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3}, ["hidden size 48", "the target 32"]),
    ({"vocab_size": 80}, ["vocabulary of 80", "the target 64"]),
    ({"num_target_layers": 6, "target_layer_ids": [4]}, ["layers [4] of 6", "the target has 2 layers"]),
    ({"mask_token_id": 64}, ["mask_token_id 64", "vocabulary of 64"]),
])
def test_a_drafter_that_does_not_fit_is_refused_naming_both_sides(target, override, words):
    with pytest.raises(ValueError) as err:
        check_drafter(drafter_for(target, **override), target, "drafter 'd'")
    assert all(w in str(err.value) for w in words), str(err.value)


def test_settings_the_drafter_cannot_run_are_refused(target, make_model):
    with pytest.raises(ValueError, match=r"num_speculative_tokens 5 is outside 1\.\.4"):
        DFlashProposer(drafter_for(target), target, num_speculative_tokens=5)
    with pytest.raises(ValueError, match="not causal"):
        check_drafter(drafter_for(target), make_model())
    with pytest.raises(ValueError, match="needs a DFlash drafter"):
        check_verified_support(target, SamplingParams(decoding="verified", draft_source="dflash"))
    attach(target, DFlashProposer(drafter_for(target), target))
    try:
        with pytest.raises(ValueError, match=r"outside 1\.\.4"):
            check_verified_support(target, SamplingParams(decoding="verified", num_speculative_tokens=6))
        with pytest.raises(ValueError, match="slots"):
            check_verified_support(target, SamplingParams(decoding="verified", draft_source="slots"))
    finally:
        attach(target, None)


@pytest.mark.parametrize("raw, words", [
    ("{nope", "not JSON"), ('["dflash"]', "JSON object"), ('{"method": "eagle3", "model": "x"}', "eagle3"),
    ('{"method": "dflash"}', "needs 'model'"), ('{"model": "x", "num_speculative_tokens": 0}', "positive integer"),
    ('{"model": "x", "draft": 1}', "unknown key"),
    ('{"model": "x", "quantization": "gguf"}', r"quantization 'gguf' is not one for a drafter's float weights \(int8"),
    ('{"model": "x", "quantization": "fp4"}', "quantization 'fp4' is not one"),
    ('{"model": "x", "draft_confidence_threshold": 1}', r"a probability in \(0, 1\), got 1"),
    ('{"model": "x", "draft_confidence_threshold": "high"}', "a probability"),
    ('{"model": "x", "draft_min_gain": -1}', r"draft_min_gain must be a number of tokens in \[0, 64\), got -1"),
])
def test_bad_speculative_configs_are_one_clear_line(raw, words):
    with pytest.raises(ValueError, match=words):
        SpeculativeConfig.parse(raw)
    assert SpeculativeConfig.parse('{"model": "d", "num_speculative_tokens": 3}') == SpeculativeConfig("dflash", "d", 3)
    spec = SpeculativeConfig.parse('{"model": "d", "quantization": "int8", "draft_confidence_threshold": 0.3}')
    assert spec.quantization == "int8" and spec.draft_confidence_threshold == 0.3
    assert SpeculativeConfig.parse('{"model": "d", "quantization": "q8_0"}').quantization == "q8_0"
    assert SpeculativeConfig.parse(spec.to_json()) == spec


def test_a_confidence_threshold_verifies_only_the_drafts_the_drafter_is_sure_of(target, trained):
    """``draft_confidence_threshold``: the leading drafts at or above it are kept (none when the first is below);
    the decoding stays the target's own greedy text and verifies fewer drafts than all k."""
    proposer = DFlashProposer(trained, target, 4, draft_confidence_threshold=0.5)
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1], [0.4, 0.35, 0.25], [0.9, 0.05, 0.05]]))
    assert proposer.confident(logits, [0, 1, 0, 0]) == [0, 1]  # the third is at 0.4: it and what follows go
    assert proposer.confident(logits[1:], [0, 1, 0]) == []
    assert DFlashProposer(trained, target, 4).confident(logits, [0, 1, 0, 0]) == [0, 1, 0, 0]
    params = SamplingParams(max_tokens=16, early_exit=False, decoding="verified", draft_source="dflash")
    counts = []
    for p in (None, proposer):
        dec = VerifiedDecoder(target, len(PROMPTS), 64, proposer=p or DFlashProposer(trained, target, 4))
        rows = [dec.add(x, params) for x in PROMPTS]
        while not all(r.finished for r in rows):
            dec.step()
        assert [r.answer[:16] for r in rows] == [greedy(target, x, 16) for x in PROMPTS]
        counts.append((sum(dec.drafted), sum(r.passes for r in rows)))
    (all_k, passes_all), (kept, passes) = counts
    assert all_k == 4 * passes_all - 4 * len(PROMPTS)  # every pass but each row's first (its prefill) drafts 4
    assert 0 < kept < 4 * (passes - len(PROMPTS))  # each row's first pass (its prefill) drafts nothing


def assert_drafts_and_stays_lossless(target, proposer) -> None:  # noqa: ANN001
    """Verified decoding of PROMPTS with ``proposer``'s drafts: it drafts, and every answer is the greedy one."""
    dec = VerifiedDecoder(target, len(PROMPTS), 64, proposer=proposer)
    params = SamplingParams(max_tokens=12, early_exit=False, decoding="verified", draft_source="dflash")
    rows = [dec.add(p, params) for p in PROMPTS]
    while not all(r.finished for r in rows):
        dec.step()
    assert proposer.calls > 0 and sum(dec.drafted) > 0
    assert [r.answer[:12] for r in rows] == [greedy(target, p, 12) for p in PROMPTS]


def test_a_quantized_drafter_scores_its_draft_vocabulary_through_an_int8_head_and_stays_lossless(target):
    """A drafter quantized at load (``speculative_config`` ``quantization``) keeps its pruned vocabulary's head rows
    as int8 (the float rows were a third of a drafter call on SmolLM2); the drafts change, the answers do not."""
    from celeris.models.quantize import Int8Linear, quantize_model, reference_linear

    drafter = drafter_for(target, draft_vocab=32)
    drafter.d2t = torch.arange(0, 64, 2)  # every other target id
    quantize_model(drafter, "int8")
    proposer = DFlashProposer(drafter, target, 3)
    head = proposer.draft_head()
    rows = target.embed_tokens.weight.detach()[drafter.d2t]  # the tiny target's head is tied
    assert isinstance(head, Int8Linear) and head.out_features == 32
    torch.testing.assert_close(head.dequantize(), rows, atol=float(rows.abs().max()) / 127, rtol=0)
    hidden = torch.randn(1, 3, rows.shape[1])
    torch.testing.assert_close(drafter.draft_logits(hidden, head), reference_linear(hidden, head), atol=0.05, rtol=0.02)
    assert_drafts_and_stays_lossless(target, proposer)


@pytest.mark.skipif(kernels.library() is None, reason="no C compiler: the block kernel is off")
def test_a_q8_0_drafter_runs_on_the_block_kernel_and_stays_lossless(target):
    """``quantization`` q8_0: every linear of the drafter and its draft head become GGUF Q8_0 blocks (gguf-py's
    quantizer) on the block kernel, with the fast pass's operators; the drafts change, the answers do not."""
    from celeris.models.blocks import BlockLinear, dequantize_blocks, quantize_blocks
    from celeris.models.quantize import quantization_of
    from celeris.sampling.drafter import quantize_drafter

    drafter = drafter_for(target, draft_vocab=32)
    drafter.d2t = torch.arange(0, 64, 2)
    weights = {n: m.weight.detach().clone() for n, m in drafter.named_modules() if isinstance(m, torch.nn.Linear)}
    proposer = DFlashProposer(drafter, target, 3)
    quantize_drafter(proposer, "q8_0")
    assert quantization_of(drafter) == "q8_0"
    fused = {n.replace("gate_proj", "gate_up_proj"): torch.cat([w, weights[n.replace("gate_proj", "up_proj")]])
             for n, w in weights.items() if n.endswith("gate_proj")}  # gate and up stacked into one product
    for name, w in {**{n: w for n, w in weights.items() if not n.endswith(("gate_proj", "up_proj"))},
                    **fused}.items():
        layer = drafter.get_submodule(name)
        assert isinstance(layer, BlockLinear) and layer.kind == "Q8_0"
        assert torch.equal(layer.dequantize(), dequantize_blocks(quantize_blocks(w), "Q8_0", w.shape[1]))
    assert drafter.norm.fast and drafter.layers[0].self_attn.fast and drafter.layers[0].mlp.fast
    head = proposer.draft_head()
    assert isinstance(head, BlockLinear) and head.out_features == 32
    rows = target.embed_tokens.weight.detach()[drafter.d2t]
    torch.testing.assert_close(head.dequantize(), rows, atol=float(rows.abs().max()) / 100, rtol=0)
    assert_drafts_and_stays_lossless(target, proposer)


def test_the_prefix_cache_keeps_the_drafters_context_features(target, trained):
    """A prompt whose first 32 tokens another prompt prefilled reuses their keys/values and their target features:
    the same tokens and acceptance lengths as without the cache."""
    shared = [(7 * i) % 50 + 4 for i in range(32)]
    prompts = [shared + [5, 6], shared + [9, 10, 11]]

    def run(prefix_cache_tokens):
        dec = VerifiedDecoder(target, 2, 96, prefix_cache_tokens, proposer=DFlashProposer(trained, target))
        params = SamplingParams(max_tokens=16, early_exit=False, decoding="verified", draft_source="dflash")
        first = dec.add(prompts[0], params)
        dec.step()  # its prefill caches the shared blocks
        second = dec.add(prompts[1], params)
        while not (first.finished and second.finished):
            dec.step()
        return dec, [first.answer, second.answer], [first.acceptance_lengths, second.acceptance_lengths]

    cached, answers, lengths = run(1024)
    assert cached.prefix_cache.hit_tokens == 32 and cached.feature_cache.hit_tokens == 32
    _, plain_answers, plain_lengths = run(0)
    assert answers == plain_answers == [greedy(target, p, 16) for p in prompts]
    assert lengths == plain_lengths


def test_lookup_first_skips_prompt_lookup_from_its_batch_size_on(target):
    """``lookup_disable_by_batch_size``: with that many rows running, ``lookup_first`` passes neither look up nor
    draft (the drafter is off too: ``disable_by_batch_size`` 1) and decode next-token; fewer rows look up."""
    loop = [4, 5, 6, 7] * 6  # prompts that repeat themselves: prompt lookup always finds a draft
    prompts = [loop + [8], loop + [9]]
    params = SamplingParams(max_tokens=12, early_exit=False, decoding="verified", draft_source="lookup_first")

    def run(rows, threshold):
        proposer = DFlashProposer(drafter_for(target), target, 3, disable_by_batch_size=1,
                                  lookup_disable_by_batch_size=threshold)
        dec = VerifiedDecoder(target, len(rows), 64, proposer=proposer)
        added = [dec.add(p, params) for p in rows]
        while not all(r.finished for r in added):
            dec.step()
        assert proposer.calls == 0
        return sum(dec.drafted), [r.answer[:12] for r in added]

    together, answers = run(prompts, 2)  # both rows run every pass (same length): never a draft
    assert together == 0 and answers == [greedy(target, p, 12) for p in prompts]
    alone, answer = run(prompts[:1], 2)
    assert alone > 0 and answer == [greedy(target, prompts[0], 12)]
    assert run(prompts, None)[0] > 0
    assert SpeculativeConfig.parse('{"model": "d", "lookup_disable_by_batch_size": 2}').lookup_disable_by_batch_size == 2


def test_draft_min_gain_probes_a_drafter_that_does_not_pay_every_probe_every_passes(target):
    """``worth_calling`` / ``record``: a row's gain is a running mean of drafter tokens accepted per call; below
    ``draft_min_gain`` the row calls the drafter only every ``PROBE_EVERY`` passes, and calls every pass again once
    its gain is back above."""
    from celeris.sampling.drafter import GAIN_WEIGHT, PROBE_EVERY, DraftState

    proposer = DFlashProposer(drafter_for(target), target, 3, draft_min_gain=0.5)
    state = DraftState()
    assert state.gain == 1.0 and proposer.worth_calling(state)  # a new row is trusted
    proposer.record(state, 0)
    assert state.gain == pytest.approx(1.0 - GAIN_WEIGHT)
    while state.gain >= 0.5:
        proposer.record(state, 0)
    calls = [proposer.worth_calling(state) for _ in range(2 * PROBE_EVERY)]
    assert calls == ([False] * (PROBE_EVERY - 1) + [True]) * 2
    for _ in range(8):
        proposer.record(state, 3)  # the text turned predictable: the probes were accepted
    assert all(proposer.worth_calling(state) for _ in range(PROBE_EVERY))
    assert all(DFlashProposer(drafter_for(target), target, 3).worth_calling(DraftState()) for _ in range(3))


def test_draft_min_gain_skips_the_drafter_on_rows_it_does_not_pay_and_keeps_the_answers(target, trained):
    """With ``draft_min_gain`` above what a drafter is ever accepted, ``lookup_first`` rows call it about once every
    ``PROBE_EVERY`` passes and decode the target's own greedy text; at 0
    it is called on every lookup miss, as without it."""
    from celeris.sampling.drafter import PROBE_EVERY

    params = SamplingParams(max_tokens=40, early_exit=False, decoding="verified", draft_source="lookup_first")

    def run(gain):
        proposer = DFlashProposer(drafter_for(target, seed=2), target, 3, draft_min_gain=gain)
        dec = VerifiedDecoder(target, len(PROMPTS), 96, proposer=proposer)
        rows = [dec.add(p, params) for p in PROMPTS]
        while not all(r.finished for r in rows):
            dec.step()
        assert [r.answer[: len(g)] for r, g in zip(rows, reference, strict=True)] == reference  # up to its end id
        return proposer.calls, sum(r.passes for r in rows)

    reference = generate_autoregressive(target, PROMPTS, SamplingParams(max_tokens=40, steps=40,
                                                                        early_exit=False)).token_ids

    (always, passes_always), (zero, _), (probing, passes) = run(None), run(0.0), run(63.0)
    assert zero == always > passes_always // 2  # every lookup miss calls the drafter
    assert 0 < probing <= passes // PROBE_EVERY + len(PROMPTS) < always
    assert SpeculativeConfig.parse('{"model": "d", "draft_min_gain": 0.25}').draft_min_gain == 0.25
