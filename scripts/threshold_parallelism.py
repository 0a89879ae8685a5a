"""Tokens per forward pass and token agreement of confidence-threshold decoding against the model's defaults.

    python scripts/threshold_parallelism.py [CHECKPOINT] [--num-prompts 16] [--lengths 128,256]

For the first N HumanEval prompts (the set shipped in ``celeris/data``), each alone through the reference sampler
function with the model's default settings (``fixed`` decoding), then with ``decoding="threshold"`` at
0.9, 0.7 and 0.5 (Fast-dLLM arXiv:2505.22618: commit every masked position of the block above the
threshold, at least the most confident one); greedy, no early exit. Prints tokens per forward
(answer tokens / NFE) and the position-wise share of tokens equal to the default's.
"""

from __future__ import annotations

import argparse

import torch

from celeris.bench.quality import heal_prompt, load_humaneval
from celeris.llm import LLM
from celeris.reference.masked import generate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="checkpoint folder (default: the embedded model)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--lengths", default="128,256", help="answer lengths in tokens, comma-separated")
    args = p.parse_args()
    llm = LLM(args.model, device="cpu")
    prompts = [llm.tokenizer.encode(heal_prompt(x["prompt"])) for x in load_humaneval()[: args.num_prompts]]
    for length in (int(n) for n in args.lengths.split(",")):
        default = None
        for threshold in (None, 0.9, 0.7, 0.5):
            extra = {} if threshold is None else {"decoding": "threshold", "threshold": threshold}
            params = llm.default_params(max_tokens=length, early_exit=False, temperature=0.0, **extra)
            outs = [generate(llm.model, [ids], params) for ids in prompts]
            answers = torch.stack([o.answer_ids[0] for o in outs])  # (N, length)
            default = answers if default is None else default
            tokens_per_forward = answers.numel() / sum(o.nfe for o in outs)
            agreement = (answers == default).float().mean().item()
            name = "defaults" if threshold is None else f"threshold {threshold}"
            print(f"{length} tokens, {name}: {tokens_per_forward:.3f} tokens per forward, "
                  f"{agreement:.1%} agreement with the defaults", flush=True)


if __name__ == "__main__":
    main()
