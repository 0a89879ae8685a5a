"""Could one pass commit more than one token *exactly*? Acceptance of a pass's runner-up predictions.

    python scripts/speculation_acceptance.py [CHECKPOINT] [--num-prompts 6] [--length 128]

Greedy decoding at one token per step (the embedded model's default; low-confidence remasking, blocks of 8,
no cache, first N HumanEval prompts) commits, at each step, the most confident masked position of the block.
A self-speculative decoder would guess that the 2nd, 3rd, ... most confident predictions of a pass are the
commits of the next steps, and verify the guesses in extra batch rows of the next pass (lossless: the text
is the one-token-per-step text). This measures how often such a chain of guesses holds: at depth d, the share
of guesses that equal the commit d steps later, given that the shallower guesses of the chain held (a chain
starts at a pass whose successor broke the previous chain). Tokens per pass of such a decoder would be about
1 + p1 + p1 * p2 + ...
"""

from __future__ import annotations

import argparse

import torch

from celeris.bench.quality import heal_prompt, load_humaneval
from celeris.llm import LLM
from celeris.sampling.step import banned_token_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="checkpoint folder (default: the embedded model)")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--length", type=int, default=128, help="answer tokens")
    p.add_argument("--depth", type=int, default=3, help="guesses per chain")
    args = p.parse_args()
    llm = LLM(args.model, device="cpu")
    model, cfg = llm.model, llm.model.config
    banned, mask_id, block = banned_token_ids(cfg), cfg.mask_token_id, 8
    hits, tries = [0] * (args.depth + 1), [0] * (args.depth + 1)
    for problem in load_humaneval()[: args.num_prompts]:
        ids = llm.tokenizer.encode(heal_prompt(problem["prompt"]))
        canvas = torch.tensor([ids + [mask_id] * args.length])  # (1, T)
        for b0 in range(len(ids), len(ids) + args.length, block):
            span = slice(b0, b0 + block)
            chain: list[tuple[tuple[int, int], int]] = []  # ((position, token), depth) guesses still to check
            while bool((canvas[0, span] == mask_id).any()):
                with torch.no_grad():
                    logits = model(canvas, None, logits_slice=span)[0]  # (block, V)
                logits[:, banned] = -torch.inf
                conf, tokens = logits.softmax(-1).max(-1)  # (block,)
                masked = canvas[0, span] == mask_id
                order = torch.where(masked, conf, -1.0).argsort(descending=True)
                commit = (int(order[0]), int(tokens[order[0]]))
                if chain:
                    guess, depth = chain.pop(0)
                    tries[depth] += 1
                    hits[depth] += guess == commit
                    if guess != commit:
                        chain = []
                canvas[0, b0 + commit[0]] = commit[1]
                if not chain:
                    left = int(masked.sum()) - 1
                    chain = [((int(order[d]), int(tokens[order[d]])), d) for d in range(1, min(args.depth, left) + 1)]
    for d in range(1, args.depth + 1):
        print(f"depth {d}: {hits[d]}/{tries[d]} guesses held ({hits[d] / max(tries[d], 1):.0%})")


if __name__ == "__main__":
    main()
