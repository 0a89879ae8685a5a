"""Masked-token accuracy of a diffusion checkpoint on held-out windows (argmax prediction).

    python scripts/masked_accuracy.py [CHECKPOINT] [--data data/stdlib]

10 windows of 256 tokens drawn with seed 0 from ``val.bin``; at 15%, 50% and 90% masking (one mask draw
each, seed 0), the share of masked positions whose argmax prediction is the original token.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from celeris.llm import LLM
from celeris.train.data import load_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="checkpoint folder (default: the embedded model)")
    p.add_argument("--data", default="data/stdlib", help="corpus folder with val.bin")
    args = p.parse_args()
    model = LLM(args.model, device="cpu").model
    val = load_tokens(f"{args.data}/val.bin")
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(val) - 256, (10,), generator=gen).tolist()
    x = torch.tensor(np.stack([val[s : s + 256].astype(np.int64) for s in starts]))  # (10, 256)
    for rate in (0.15, 0.5, 0.9):
        masked = torch.rand(x.shape, generator=gen) < rate
        with torch.no_grad():
            pred = model(torch.where(masked, model.config.mask_token_id, x)).argmax(-1)
        print(f"{rate:.0%} masked: accuracy {float((pred[masked] == x[masked]).float().mean()):.3f}")


if __name__ == "__main__":
    main()
