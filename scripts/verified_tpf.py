"""Tokens per forward and draft acceptance of verified decoding on HumanEval prompts (greedy, no early exit).

    python scripts/verified_tpf.py --run runs/hybrid --num-prompts 16 --max-tokens 256 --draft-source slots
    python scripts/verified_tpf.py --model celeris-code-6m-hybrid ...

Prints one JSON line: the checkpoint's training step (for --run), tokens per forward (prefill included) and
the share of drafts accepted at each draft position. All prompts run as one batch on one thread.
"""

from __future__ import annotations

import argparse
import json

import torch

from celeris.bench.quality import heal_prompt, load_humaneval
from celeris.engine.verified import generate_verified
from celeris.llm import resolve_model
from celeris.models.loader import load_model
from celeris.sampling.params import SamplingParams
from celeris.tokenizer import Tokenizer
from celeris.train.loop import load_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="celeris-code-6m-ar", help="checkpoint (or --run's config and tokenizer)")
    ap.add_argument("--run", help="a hybrid training run folder: its last.pt (celeris.train.loop.load_run)")
    ap.add_argument("--prompts", help="HumanEval JSONL(.gz) (default: the set shipped in celeris/data)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--draft-source", default="lookup_first", choices=["lookup_first", "slots", "lookup"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, step = load_run(args.run) if args.run else (load_model(resolve_model(args.model)), None)
    tok = Tokenizer(resolve_model(args.model))
    problems = load_humaneval(args.prompts)[: args.num_prompts]
    ids = [tok.encode(heal_prompt(p["prompt"])) for p in problems]
    params = SamplingParams(max_tokens=args.max_tokens, steps=1, block_length=1, early_exit=False,
                            decoding="verified", draft_source=args.draft_source)
    out = generate_verified(model, ids, params)
    print(json.dumps({"step": step, "draft_source": args.draft_source, "tokens_per_forward":
                      round(out.tokens_per_forward, 3), "acceptance": [round(a, 3) for a in out.acceptance],
                      "seconds": round(out.seconds, 1)}))


if __name__ == "__main__":
    main()
