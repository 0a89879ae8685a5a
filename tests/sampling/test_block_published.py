"""The block sampler against an independent, plain re-implementation of SDAR's published loop (JetAstra/SDAR
``generate.py``, ``block_diffusion_generate``), greedy: canvas padded to whole blocks, a ``tril`` block mask
over them, ``get_num_transfer_tokens(block_length, steps)``, the static and dynamic rules, the mask id never
predicted. Prompt length + max_tokens are not multiples of the block size, so the prompt's last block and the
answer's padded last block are both exercised; the engine must give the same tokens as the reference."""

from __future__ import annotations

import pytest
import torch

from celeris.config import EngineConfig
from celeris.engine import Engine
from celeris.models.loader import load_any
from celeris.reference.block import generate_block
from celeris.sampling.params import SamplingParams
from tests.models.conftest_block_formats import write_sdar

PAIRS = [(5, 6), (6, 9), (7, 8), (3, 2)]  # (prompt length, max_tokens); block size 4


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sdar")
    write_sdar(folder, scale=3.0)
    return load_any(folder, dtype=torch.float64)


@torch.no_grad()
def published_sdar(model, prompt: list[int], n: int, steps: int, rule: str, threshold: float,
                   stop_ids: set[int] = frozenset()) -> tuple[list[int], int]:
    """SDAR's loop, written out plainly (full recompute instead of its KV cache). Returns (answer, passes)."""
    mask_id, bs = model.config.mask_token_id, model.block_contract.block_size
    p = len(prompt)
    num_blocks = -(-(p + n) // bs)
    x = torch.full((num_blocks * bs,), mask_id)
    x[:p] = torch.tensor(prompt)
    allowed = torch.tril(torch.ones(num_blocks, num_blocks, dtype=torch.bool))
    allowed = allowed.repeat_interleave(bs, 0).repeat_interleave(bs, 1)
    counts = [bs // steps + (1 if i < bs % steps else 0) for i in range(steps)]
    passes = 0
    for b in range(p // bs, num_blocks):
        lo, end = b * bs, (b + 1) * bs
        for step in range(steps + 1):
            is_masked = x[lo:end] == mask_id
            if not is_masked.any():
                break
            hidden = model.hidden_states(x[None, :end], layout_mask=allowed[None, None, :end, :end])
            logits = model.logits(hidden)[0, lo:end].double()
            passes += 1
            logits[:, mask_id] = -float("inf")
            probs = logits.softmax(-1)
            x0 = probs.argmax(-1)
            conf = torch.where(is_masked, probs.gather(-1, x0[:, None])[:, 0], torch.tensor(-float("inf")))
            k = counts[step]
            chosen = torch.zeros(bs, dtype=torch.bool)
            if rule == "low_confidence_dynamic" and int((conf > threshold).sum()) >= k:
                chosen = conf > threshold
            else:
                chosen[conf.topk(k).indices] = True
            chosen &= is_masked  # the published loop can pick a prompt column when k > masked; never committed
            x[lo:end] = torch.where(chosen, x0, x[lo:end])
        if stop_ids & set(x[p:].tolist()):
            break
    return x[p : p + n].tolist(), passes


@pytest.mark.parametrize("rule, steps", [("low_confidence_static", 4), ("low_confidence_dynamic", 4),
                                         ("low_confidence_static", 3), ("low_confidence_dynamic", 2)])
def test_reference_and_engine_equal_the_published_sdar_loop(sdar, rule, steps):
    extra = {"threshold": 0.3} if rule.endswith("dynamic") else {}
    for p, n in PAIRS:
        prompt = list(range(5, 5 + p))
        expected, passes = published_sdar(sdar, prompt, n, steps, rule, 0.3)
        params = SamplingParams(max_tokens=n, steps=steps, block_length=4, decoding=rule, early_exit=False, **extra)
        ref = generate_block(sdar, [prompt], params)
        assert ref.answer_ids[0].tolist() == expected, (p, n)
        assert ref.nfe == passes, (p, n)  # same denoising passes (the published store-only pass aside)
        engine = Engine(sdar, EngineConfig())
        request = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        assert request.answer.tolist() == expected, (p, n)


def test_early_exit_stops_once_the_end_is_final(sdar):
    """Same tokens as the published loop's stop after the block, in fewer passes: the answer ends as soon as an
    end id is committed with every position before it filled."""
    prompt, n = list(range(5, 11)), 14
    full, _ = published_sdar(sdar, prompt, n, 4, "low_confidence_static", 0.3)
    saved = 0
    for stop_id in dict.fromkeys(full[:10]):
        expected, passes = published_sdar(sdar, prompt, n, 4, "low_confidence_static", 0.3, {stop_id})
        params = SamplingParams(max_tokens=n, steps=4, block_length=4, decoding="low_confidence_static")
        ref = generate_block(sdar, [prompt], params, end_ids=[stop_id])
        engine = Engine(sdar, EngineConfig(), end_ids=[stop_id])
        request = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        cut = expected[: expected.index(stop_id)]
        assert ref.token_ids[0] == cut and request.final_prefix() == cut and request.finish_reason == "stop"
        assert request.nfe == ref.nfe <= passes
        saved += passes - ref.nfe
    assert saved > 0


# ---------------------------------------------------------------------------------------------
# Fast-dLLM v2 (issue 28 item 11): its published ``generate()`` (``modeling.py`` of the released folders)


@pytest.fixture(scope="module")
def fast_dllm(tmp_path_factory):
    from tests.models.conftest_block_formats import write_fast_dllm

    folder = tmp_path_factory.mktemp("fast_dllm")
    write_fast_dllm(folder, scale=3.0)  # bd_size 8
    return load_any(folder, dtype=torch.float64)


@torch.no_grad()
def published_fast_dllm(model, prompt: list[int], n: int, small: int, threshold: float) -> tuple[list[int], int]:
    """Fast-dLLM v2's ``generate()`` written out plainly, greedy (full recompute under the block-causal mask
    instead of its KV cache). Blocks of ``bd_size`` at multiples of it; before a block is denoised, its first
    token is committed as the argmax of the finished history's last logits (the prompt's prefill when the
    prompt ends on a block boundary); each ``small``-token sub-block then commits every masked position whose
    probability exceeds ``threshold``, and at least the most probable one, from logits shifted one to the right.
    Two deliberate differences, as in Celeris: the banned ids (the mask and pad tokens) are never predicted, and
    a prompt of exactly ``bd_size`` tokens is prefilled like any other whole block (the published test
    ``input_ids.shape[1] > block_size`` skips it and denoises the first block without the prompt). Returns
    (the answer's first ``n`` tokens, passes that committed a token)."""
    from celeris.sampling.step import banned_token_ids

    mask_id, bs = model.config.mask_token_id, model.block_contract.block_size
    banned = banned_token_ids(model.config)
    p = len(prompt)

    def logits_of(ids: list[int]) -> torch.Tensor:
        """(len(ids), V) unshifted logits (row i predicts token i + 1), banned ids removed."""
        blocks = -(-len(ids) // bs)
        allowed = torch.tril(torch.ones(blocks, blocks, dtype=torch.bool))
        allowed = allowed.repeat_interleave(bs, 0).repeat_interleave(bs, 1)[: len(ids), : len(ids)]
        logits = model.logits(model.hidden_states(torch.tensor([ids]), layout_mask=allowed[None, None]))[0].double()
        logits[:, banned] = -float("inf")
        return logits

    x, passes = list(prompt), 0
    if p >= bs and p % bs == 0:  # the prefill's last logits give the first answer token
        x.append(int(logits_of(x)[-1].argmax()))
        passes += 1
    while True:
        x = x + [mask_id] * (bs - len(x) % bs)  # the block the answer continues in, padded with masks
        for lo in range(len(x) - bs, len(x), small):
            while mask_id in x[lo : lo + small]:
                logits = logits_of(x)[-bs:]
                logits = torch.cat([logits[:1], logits[:-1]])  # position i of the block from the hidden state at i - 1
                passes += 1
                probs = logits.softmax(-1)
                x1 = probs.argmax(-1)
                start = lo - (len(x) - bs)
                is_masked = torch.tensor(x[-bs:]) == mask_id
                conf = probs.gather(-1, x1[:, None])[:, 0]
                conf = torch.where(is_masked, conf, torch.tensor(-float("inf")))
                conf[:start], conf[start + small :] = -float("inf"), -float("inf")
                chosen = conf > threshold
                chosen[conf.argmax()] = True
                chosen &= is_masked
                block = x[-bs:]
                x[-bs:] = [int(x1[i]) if chosen[i] else block[i] for i in range(bs)]
        if len(x) >= p + n:
            return x[p : p + n], passes
        x.append(int(logits_of(x)[-1].argmax()))  # the finished block's pass: the next block's first token
        passes += 1


FAST_CASES = [(3, 10), (8, 9), (11, 13), (16, 6), (5, 3)]  # (prompt length, max_tokens); bd_size 8


@pytest.mark.parametrize("small, threshold", [(4, 0.5), pytest.param(8, 0.9, marks=pytest.mark.slow),
                                              pytest.param(2, 0.99, marks=pytest.mark.slow)])
def test_reference_and_engine_equal_the_published_fast_dllm_loop(fast_dllm, small, threshold):
    """Issue 28 item 11: Celeris committed a block's first token in the block's first denoising step, together
    with what the rule chose there (computed with that token still masked); the published loop commits it first."""
    for p, n in FAST_CASES:
        prompt = list(range(5, 5 + p))
        expected, passes = published_fast_dllm(fast_dllm, prompt, n, small, threshold)
        params = SamplingParams(max_tokens=n, steps=small, block_length=small, decoding="threshold",
                                threshold=threshold, early_exit=False)
        ref = generate_block(fast_dllm, [prompt], params)
        assert ref.answer_ids[0].tolist() == expected, (p, n)
        assert ref.nfe == passes, (p, n)
        engine = Engine(fast_dllm, EngineConfig())
        request = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        assert request.answer.tolist() == expected, (p, n)
        assert request.nfe == passes, (p, n)


# ---------------------------------------------------------------------------------------------
# LLaDA2.0 (issue 28 item 11): its ``generate`` is SDAR's loop with ``steps = min(steps, gen_length // minimal_topk)``


def test_llada2_steps_are_capped_at_an_answer_shorter_than_a_block(tmp_path):
    """A 3-token answer in a 32-token block: the published loop spreads the block over min(32, 3) = 3 steps (its
    ``get_num_transfer_tokens(block_length, steps)`` of the capped steps); Celeris took up to 32."""
    from tests.models.conftest_block_formats import write_llada2

    write_llada2(tmp_path / "m", scale=3.0)
    model = load_any(tmp_path / "m", dtype=torch.float64)
    params = SamplingParams(**model.block_contract.defaults | {"max_tokens": 3, "early_exit": False})
    assert (params.steps, params.block_length, model.block_contract.block_size) == (32, 32, 32)
    for prompt in ([5, 6, 7], list(range(5, 40))):
        expected, passes = published_sdar(model, prompt, 3, 3, "low_confidence_dynamic", params.threshold)
        ref = generate_block(model, [prompt], params)
        assert ref.answer_ids[0].tolist() == expected and ref.nfe == passes <= 3
        engine = Engine(model, EngineConfig())
        request = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        assert request.answer.tolist() == expected and request.nfe == passes
