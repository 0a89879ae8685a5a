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
from celeris.params import SamplingParams
from celeris.sampling.block import generate_block
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
