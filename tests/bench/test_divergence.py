"""Quantization quality (celeris.bench.divergence) on the embedded 6M models: the floors of issue 29, asserted in
every decoding mode, and the measure itself against a hand-written teacher-forced KL."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from celeris.bench.divergence import (
    EMBEDDED_MODES,
    Divergence,
    floor_of,
    floor_warning,
    humaneval_prompts,
    measure_divergence,
)
from celeris.llm import LLM

# the fixed prompt set: the bench's first 8 HumanEval prompts, each its last 64 tokens; 32 answer tokens each
NUM_PROMPTS = 8
_LOADED: dict[tuple[str, str | None], LLM] = {}


def loaded(model: str, quantization: str = "none") -> LLM:  # "none": float32, the reference
    key = (model, quantization)
    if key not in _LOADED:
        _LOADED[key] = LLM(model, device="cpu", quantization=quantization)
    return _LOADED[key]


class KeptAnswers:
    """A reference ``LLM`` whose answers are kept per prompt and settings (greedy, so the same every time): the
    int8 and int4 floors are measured against one decoding of the reference, not two. Everything else is the
    ``LLM``'s own."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.kept = llm, {}

    def __getattr__(self, name: str) -> object:
        return getattr(self.llm, name)

    def generate(self, prompts: list, params: object, **kwargs: object) -> list:
        if kwargs:  # a step callback (the masked and block modes' trajectories) must see the decoding
            return self.llm.generate(prompts, params, **kwargs)
        key = (repr(prompts), repr(params))
        if key not in self.kept:
            self.kept[key] = self.llm.generate(prompts, params)
        return self.kept[key]


_KEPT: dict[str, KeptAnswers] = {}


# the masked and block cases re-run full passes for every denoising step of both models (~15-28 s each on 2 cores):
# slow tier; the verified case (~3 s) stays in the fast tier
SLOW_MODES = {"masked", "block"}


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW_MODES else m for m in EMBEDDED_MODES])
def test_quantized_models_meet_the_floors_in_every_mode(mode, method):
    model, settings = EMBEDDED_MODES[mode]
    ref = _KEPT.setdefault(model, KeptAnswers(loaded(model)))
    prompts = humaneval_prompts(ref, NUM_PROMPTS)
    d = measure_divergence(ref, loaded(model, method), prompts, ref.default_params(**settings))
    top1, kl = floor_of(method)
    assert d.tokens >= 150  # answers may end early, most run their 32 tokens
    assert d.top1_agreement >= top1, d
    assert d.mean_kl <= kl, d
    assert floor_warning(method, d) is None
    assert len(d.first_divergence) == NUM_PROMPTS


def test_the_reference_against_itself_agrees_everywhere():
    ref = loaded("celeris-code-6m")
    prompt = humaneval_prompts(ref, 1)[0]  # cut as the floors' prompts (halves the passes' width)
    # the block mode's settings over two blocks of 8 (16 tokens, not 32): the trajectory is scored canvas by canvas
    block = {**EMBEDDED_MODES["block"][1], "max_tokens": 16, "steps": 16}
    d = measure_divergence(ref, ref, [prompt], ref.default_params(**block))
    assert d.tokens > 0 and d.top1_agreement == 1.0 and d.mean_kl == pytest.approx(0.0, abs=1e-7)
    assert d.first_divergence == [None]


@torch.no_grad()
def test_the_causal_measure_is_the_teacher_forced_kl_written_out():
    ref, cand = loaded("celeris-code-6m-hybrid"), loaded("celeris-code-6m-hybrid", "int4")
    params = ref.default_params(max_tokens=16, decoding="verified", temperature=0.0)
    kls, same = [], []
    prompts = humaneval_prompts(ref, 3)  # cut as the floors' prompts
    for ids in prompts:
        answer = ref.generate([ids], params)[0].token_ids
        canvas = torch.tensor([ids + answer])
        # next-token distributions from the hidden state before each answer token
        lp = ref.model.logits(ref.model.hidden_states(canvas)[0, len(ids) - 1 : -1]).log_softmax(-1)
        lq = cand.model.logits(cand.model.hidden_states(canvas)[0, len(ids) - 1 : -1]).log_softmax(-1)
        kls.append(F.kl_div(lq, lp, log_target=True, reduction="none").sum(-1))
        same.append(lp.argmax(-1) == lq.argmax(-1))
    d = measure_divergence(ref, cand, prompts, params)
    assert d.tokens == sum(len(k) for k in kls)
    assert d.mean_kl == pytest.approx(float(torch.cat(kls).mean()), rel=1e-4, abs=1e-7)
    assert d.top1_agreement == pytest.approx(float(torch.cat(same).float().mean()))


def test_a_missed_floor_is_one_warning_line():
    line = floor_warning("int4-g64", Divergence(100, 0.85, 0.02, [None]))
    assert line == ("warning: int4-g64 misses its quality floor: top-1 agreement 0.8500 (floor 0.9), mean KL 0.02000 "
                    "nats (ceiling 0.1)")
    held = floor_warning("bfloat16", Divergence(100, 0.98, 0.001, [None]), "int8")  # the bench's bfloat16 width
    assert held == ("warning: bfloat16 misses its quality floor (int8's): top-1 agreement 0.9800 (floor 0.99), mean "
                    "KL 0.00100 nats (ceiling 0.01)")
