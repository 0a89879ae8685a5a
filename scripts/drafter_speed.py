"""Tokens/s of SmolLM2-135M-Instruct at batch 1: next-token decoding and prompt lookup against a DFlash drafter at k
drafts per pass.

One process (``--threads``, default one), the same held-out prompts (the first MT-Bench first turns and GSM8K test
questions, never in the drafter's data) through the chat template, greedy; the systems run interleaved,
``--repeats`` rounds, and the best round per system is reported with its tokens per target pass. Every system's
text must equal prompt lookup's (verified decoding is lossless at temperature 0): a mismatch is printed and makes
the exit status 1.

    OMP_NUM_THREADS=1 python scripts/drafter_speed.py --drafter runs/dflash/export --k 1,2,3,7
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from celeris import LLM


def prompts(shared: Path, n: int) -> list[str]:
    """The first ``n`` MT-Bench first turns and the first ``n`` GSM8K test questions, alternating."""
    mt = [json.loads(x)["turns"][0] for x in (shared / "data/mt_bench/question.jsonl").read_text().splitlines()[:n]]
    gsm = [json.loads(x)["question"] for x in (shared / "data/gsm8k/test.jsonl").read_text().splitlines()[:n]]
    return [p for pair in zip(mt, gsm, strict=True) for p in pair]


def run(llm: LLM, texts: list[str], max_tokens: int, source: str) -> tuple[float, int, int, list[str]]:
    """(seconds, answer tokens, target passes, texts) for the prompts one at a time."""
    # no source: next-token decoding (the chat bench's target-next-token)
    params = (llm.default_params(max_tokens=max_tokens, seed=0, decoding="verified", draft_source=source) if source
              else llm.default_params(max_tokens=max_tokens, seed=0, decoding="fixed"))
    seconds = tokens = passes = 0
    out_texts = []
    for t in texts:
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": t}])
        start = time.perf_counter()
        out = llm.generate([ids], params)[0]
        seconds += time.perf_counter() - start
        tokens += len(out.token_ids)
        passes += out.nfe
        out_texts.append(out.text)
    return seconds, tokens, passes, out_texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", type=Path, required=True)
    ap.add_argument("--k", default="1,2,3,7")
    ap.add_argument("--shared", type=Path, default=Path("../shared"))
    ap.add_argument("--num-prompts", type=int, default=2, help="of each set")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lookup-first", action="store_true", help="also draft_source lookup_first at each k")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    texts = prompts(args.shared, args.num_prompts)
    target = LLM("smollm2-135m-instruct")
    systems = {"lookup": (target, "lookup"), "dflash-k0 (next-token)": (target, None)}
    for k in (int(x) for x in args.k.split(",")):
        spec = {"method": "dflash", "model": str(args.drafter), "num_speculative_tokens": k}
        llm = LLM("smollm2-135m-instruct", speculative_config=spec)
        systems[f"dflash-k{k}"] = (llm, "dflash")
        if args.lookup_first:  # prompt lookup first, the drafter where lookup finds nothing (the default's source)
            systems[f"lookup-first-k{k}"] = (llm, "lookup_first")
    best: dict[str, tuple] = {}
    for _ in range(args.repeats):
        for name, (llm, source) in systems.items():
            r = run(llm, texts, args.max_tokens, source)
            if name not in best or r[0] < best[name][0]:
                best[name] = r
    bad = 0
    for name, (seconds, tokens, passes, out) in best.items():
        same = out == best["lookup"][3]
        bad += not same
        print(f"{name}: {tokens / seconds:.2f} tokens/s, {tokens / max(passes, 1):.3f} tokens per target pass, "
              f"{tokens} tokens, text equal to lookup's: {same}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
