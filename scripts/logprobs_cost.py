"""Tokens/s with and without logprobs (issue 30: asking for nothing costs nothing), side by side in one process.

    OMP_NUM_THREADS=1 python scripts/logprobs_cost.py

The embedded autoregressive twin decodes the first 8 HumanEval prompts batched, 128 tokens each (end ignored), with
logprobs None, 0, 5 and 20 (top alternatives), interleaved, best of 5 runs each.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from celeris import LLM
from celeris.bench.quality import heal_prompt, load_humaneval


def main() -> None:
    torch.set_num_threads(1)
    llm = LLM("celeris-code-6m-ar")
    prompts = [heal_prompt(p["prompt"]) for p in load_humaneval()[:8]]
    base = llm.default_params(max_tokens=128, temperature=0.0, ignore_eos=True)
    runs = {"none": base, **{f"logprobs={k}": replace(base, logprobs=k) for k in (0, 5, 20)}}
    llm.generate(prompts, base)
    best = {k: 1e9 for k in runs}
    for _ in range(5):
        for k, p in runs.items():
            start = time.perf_counter()
            out = llm.generate(prompts, p)
            best[k] = min(best[k], time.perf_counter() - start)
    n = sum(len(o.token_ids) for o in out)
    for k, v in best.items():
        print(f"{k}: {n / v:.1f} tok/s (8 prompts batched, {n} tokens, best of 5 interleaved)")


if __name__ == "__main__":
    main()
