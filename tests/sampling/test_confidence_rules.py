"""Issue 13 item 5: each format's published confidence rule. LLaDA's ``generate()`` ranks positions by
``softmax(logits)`` with the mask token's probability still in the denominator; Dream and SDAR (and Celeris)
take it from the filtered distribution (banned ids removed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from celeris.config import EngineConfig
from celeris.engine import Engine
from celeris.models.loader import load_any
from celeris.reference.masked import generate
from celeris.sampling.params import SamplingParams
from celeris.sampling.step import RowSettings, confidence_rule, denoise_step
from tests.engine.test_engine import run_to_end
from tests.models.conftest_formats import write_llada

MASK = 1


def crafted_logits() -> torch.Tensor:
    """Two masked positions: position 0's top token competes with a likely mask token, position 1's does not."""
    logits = torch.zeros(1, 2, 5)
    logits[0, 0, 3], logits[0, 0, MASK] = 2.0, 3.0  # banned: p(3) = 0.71; unbanned: 0.24
    logits[0, 1, 4], logits[0, 1, MASK] = 1.5, -10.0  # p(4) = 0.60 either way
    return logits


@pytest.mark.parametrize("rule, committed", [("unfiltered", 1), ("filtered", 0)])
def test_rule_decides_the_commit_order(rule, committed):
    block = torch.full((1, 2), MASK)
    settings = RowSettings.from_params([SamplingParams()], torch.device("cpu"))
    new, chosen = denoise_step(crafted_logits(), block, MASK, [MASK], torch.tensor([1]), settings,
                               [torch.Generator()], confidence_from=rule)
    assert chosen[0].nonzero().flatten().tolist() == [committed]
    assert MASK not in new[0, chosen[0]].tolist()  # the prediction itself never is the mask token


def published_llada_generate(model, prompt: list[int], steps: int, gen_length: int, block_length: int,
                             mask_id: int) -> list[int]:
    """LLaDA's published ``generate()`` (GSAI-ML/LLaDA generate.py), temperature 0, low-confidence remasking,
    written as its plain loop; the only change is the same ban of the mask token from the argmax."""
    x = torch.full((1, len(prompt) + gen_length), mask_id, dtype=torch.long)
    x[0, : len(prompt)] = torch.tensor(prompt)
    lp, num_blocks = len(prompt), gen_length // block_length
    steps_per_block = steps // num_blocks
    for b in range(num_blocks):
        start, end = lp + b * block_length, lp + (b + 1) * block_length
        n = int((x[:, start:end] == mask_id).sum())
        num_transfer = [n // steps_per_block + (1 if i < n % steps_per_block else 0) for i in range(steps_per_block)]
        for i in range(steps_per_block):
            mask_index = x == mask_id
            logits = model(x, torch.ones_like(x, dtype=torch.bool))  # (1, T, V)
            x0 = logits.masked_fill(torch.arange(logits.shape[-1]) == mask_id, float("-inf")).argmax(-1)
            p = F.softmax(logits, dim=-1)  # the published rule: the whole vocabulary
            x0_p = torch.gather(p, -1, x0[..., None]).squeeze(-1)
            x0_p[:, end:] = float("-inf")
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.tensor(float("-inf")))
            _, select = torch.topk(confidence[0], k=num_transfer[i])
            x[0, select] = x0[0, select]
    return x[0, lp:].tolist()


@pytest.fixture(scope="module")
def llada_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llada-rule") / "LLaDA-tiny"
    write_llada(folder, num_shards=1, seed=4)
    model = load_any(folder)
    head = model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a mask probability that varies a lot between positions, so the two rules disagree often
        head[model.config.mask_token_id] = torch.randn(head.shape[1], generator=g) * 10
    return model


def test_llada_format_uses_its_published_rule(llada_model):
    assert confidence_rule(llada_model) == "unfiltered"


@pytest.mark.parametrize("prompt", [[5, 6, 7], [40, 41, 42, 43, 44], [9], [100, 3, 77, 12], [11, 12],
                                    [200, 201, 50]])
def test_llada_path_matches_the_published_loop(llada_model, prompt):
    mask_id = llada_model.config.mask_token_id
    expected = published_llada_generate(llada_model, prompt, steps=8, gen_length=8, block_length=4, mask_id=mask_id)
    params = SamplingParams(max_tokens=8, steps=8, block_length=4, early_exit=False)
    assert generate(llada_model, [prompt], params).answer_ids[0].tolist() == expected
    engine = Engine(llada_model, EngineConfig(max_num_seqs=2))
    request = engine.add_request(prompt, params)
    run_to_end(engine)
    assert request.answer.tolist() == expected


def published_dream_sample_tokens(logits: torch.Tensor, top_p: float | None, top_k: int | None, alg: str):
    """Dream's published ``sample_tokens`` (DreamLM ``generation_utils.py``) at temperature 0 for one (N, V) set of
    masked positions, as a plain transcription: top-p, then top-k (``finfo.min`` fill), softmax, the argmax token,
    and the ``alg``'s confidence (``maskgit_plus``: its probability; ``topk_margin``: top-1 minus top-2;
    ``entropy``: sum p log(p + 1e-10))."""
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
        remove = cum > top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = False
        mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, remove)
        logits = logits.masked_fill(mask, torch.finfo(logits.dtype).min)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)))[0][..., -1, None]
        logits = logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits, dim=-1)
    confidence, x0 = probs.max(dim=-1)
    if alg == "topk_margin":
        sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)
        confidence = sorted_probs[:, 0] - sorted_probs[:, 1]
    if alg == "entropy":
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0


@pytest.mark.parametrize("remasking, alg", [("low_confidence", "maskgit_plus"), ("margin", "topk_margin"),
                                            ("entropy", "entropy")])
@pytest.mark.parametrize("top_k, top_p", [(None, None), (3, None), (4, 0.8)])
def test_dream_rules_commit_what_dreams_sampler_would(remasking, alg, top_k, top_p):
    """Issue 16 item 4: each step commits the positions Dream's published sampler ranks first (its ``alg``), with
    its tokens, after its top-p and top-k filters; over random blocks with some positions already filled."""
    vocab, length, num_tokens = 40, 16, 4
    differs_from_maskgit = differs_from_unfiltered = False
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(1, length, vocab, generator=g) * 1.5
        logits[..., MASK] = float("-inf")  # Dream's mask token is never predicted either
        block = torch.full((1, length), MASK)
        block[0, [1, 5]] = 7  # already committed
        params = SamplingParams(remasking=remasking, top_k=top_k, top_p=top_p if top_p is not None else 1.0)
        settings = RowSettings.from_params([params], torch.device("cpu"))
        new, chosen = denoise_step(logits, block, MASK, [MASK], torch.tensor([num_tokens]), settings,
                                   [torch.Generator()], confidence_from="filtered")
        masked = [i for i in range(length) if block[0, i] == MASK]

        def dream_commits(tk, tp, rule, logits=logits, masked=masked):
            confidence, _ = published_dream_sample_tokens(logits[0, masked], tp, tk, rule)
            return sorted(masked[j] for j in torch.topk(confidence, num_tokens).indices.tolist())

        want = dream_commits(top_k, top_p, alg)
        _, x0 = published_dream_sample_tokens(logits[0, masked], top_p, top_k, alg)
        assert chosen[0].nonzero().flatten().tolist() == want, seed
        assert new[0, want].tolist() == [x0[masked.index(i)].item() for i in want]
        differs_from_maskgit |= want != dream_commits(top_k, top_p, "maskgit_plus")
        differs_from_unfiltered |= want != dream_commits(None, None, alg)
    # the cases tell the rules apart: a confidence or filter that were ignored would fail above
    assert differs_from_maskgit or alg == "maskgit_plus" or top_k is not None
    assert differs_from_unfiltered or top_k is None or alg == "topk_margin"
