"""Self-distillation data for a hybrid model: its own greedy continuations of training-corpus windows.

dParallel (arXiv:2509.26488) and d3LLM (arXiv:2601.07568) train a dLLM's parallel drafts on the model's own
outputs: they are a deterministic function of the prefix, which is what verified decoding checks the drafts
against. Prompts are random windows of the training split (never HumanEval); continuations come from verified
decoding at temperature 0, which equals the model's greedy next-token decoding.

    python scripts/self_distill_data.py --run runs/hybrid --data data/stdlib --out runs/distill.bin \\
        --num-sequences 2048 --prompt-len 64 --gen-len 128

Writes (N, prompt_len + gen_len) uint16 rows; prints one JSON line with the counts and seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from celeris.engine.verified import generate_verified
from celeris.sampling.params import SamplingParams
from celeris.train.loop import load_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="hybrid training run folder (its last.pt)")
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-sequences", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, step = load_run(args.run)
    tokens = np.memmap(f"{args.data}/train.bin", dtype=np.uint16, mode="r")
    rng = np.random.default_rng(args.seed)
    starts = rng.integers(0, len(tokens) - args.prompt_len, size=args.num_sequences)
    params = SamplingParams(max_tokens=args.gen_len, steps=1, block_length=1, early_exit=False,
                            decoding="verified", draft_source="lookup_first")
    start = time.perf_counter()
    tmp = args.out + ".tmp"
    with open(tmp, "wb") as handle:
        for i in range(0, args.num_sequences, args.batch_size):
            prompts = [tokens[s : s + args.prompt_len].astype(np.int64).tolist() for s in starts[i : i + args.batch_size]]
            out = generate_verified(model, prompts, params)
            for p, ans in zip(prompts, out.token_ids, strict=True):
                ans = (ans + [model.config.eos_token_id] * args.gen_len)[: args.gen_len]  # cut at end-of-text: pad
                np.asarray(p + ans, dtype=np.uint16).tofile(handle)
    os.replace(tmp, args.out)
    print(json.dumps({"step": step, "sequences": args.num_sequences,
                      "tokens": args.num_sequences * (args.prompt_len + args.gen_len),
                      "seconds": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
