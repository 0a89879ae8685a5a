"""Draft acceptance of a hybrid model on held-out standard-library code (teacher-forced).

For N random held-out windows: the true prefix (``--prefix`` tokens), then k fully masked slots after it in
one pass (the drafting condition of verified decoding). The model's own greedy next-token continuation g_1 ..
g_{k+1} of the same prefix is the reference; slot j drafts g_{j+1} (g_1 comes from the next-token head at the
prefix's last token). Reported: per slot, the share of drafts equal to the greedy token, and the mean number
of leading slots that match: mean + 1 bounds the tokens per forward of verified decoding from above.

    python scripts/draft_acceptance.py --model runs/hybrid-export --data data/stdlib --k 4 8 --n 200
    python scripts/draft_acceptance.py --run runs/hybrid ...   # a training run's last.pt
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from celeris.engine.verified import VerifiedDecoder
from celeris.llm import resolve_model
from celeris.models.loader import load_model
from celeris.reference.autoregressive import generate_autoregressive
from celeris.sampling.params import SamplingParams
from celeris.train.loop import load_run


@torch.no_grad()
def acceptance(model: torch.nn.Module, prefixes: torch.Tensor, k: int) -> dict:
    """(N, P) int64 true prefixes -> per-slot match rates and the mean leading-match length for k slots."""
    n, p = prefixes.shape
    out = generate_autoregressive(model, prefixes.tolist(), SamplingParams(max_tokens=k + 1, steps=k + 1,
                                                                           block_length=1, early_exit=False))
    greedy = out.answer_ids  # (N, k + 1)
    model.config.draft_block_size = k  # k mask slots after the prefix (the model was trained with its own k)
    dec = VerifiedDecoder(model, n, p + 1)
    for row in prefixes.tolist():
        dec.add(row, SamplingParams(max_tokens=1, steps=1, block_length=1))
    drafts = dec._run(0, n, fresh=True)[:, p : p + k].argmax(-1)  # (N, k): slot j drafts g_{j+1}
    match = drafts == greedy[:, 1:]
    leading = match.long().cumprod(-1).sum(-1).float()
    return {"k": k, "per_slot": [round(float(x), 4) for x in match.float().mean(0)],
            "mean_leading": round(float(leading.mean()), 4), "tpf_bound": round(float(leading.mean()) + 1, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="hybrid checkpoint folder or name")
    ap.add_argument("--run", help="a hybrid training run folder: its last.pt (celeris.train.loop.load_run)")
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, step = load_run(args.run) if args.run else (load_model(resolve_model(args.model)), None)
    tokens = np.memmap(f"{args.data}/val.bin", dtype=np.uint16, mode="r")
    rng = np.random.default_rng(args.seed)
    starts = rng.integers(0, len(tokens) - args.prefix - 16, size=args.n)
    prefixes = torch.from_numpy(np.stack([tokens[s : s + args.prefix].astype(np.int64) for s in starts]))
    results = [acceptance(model, prefixes, k) for k in args.k]
    print(json.dumps({"step": step, "n": args.n, "prefix": args.prefix, "results": results}))


if __name__ == "__main__":
    main()
