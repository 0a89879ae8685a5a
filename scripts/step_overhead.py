"""Per-step overhead of the engine beside its forward passes (issue 48, item 4): for next-token decoding and the
default's verified decoding at batch 1, the wall time of each ``Engine.step`` split into the target's passes (the
model entries the runner calls: ``forward``, ``layout_hidden_states``, ``logits``), the drafter's calls
(``DFlashProposer.propose_draft_vocab``) and the rest (scheduler, sampler, penalties, stop strings, bookkeeping), in
microseconds per step, on the chat bench's first prompts.

    OMP_NUM_THREADS=1 python scripts/step_overhead.py --threads 1 --num-prompts 4 --max-tokens 128
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from celeris import LLM
from celeris.bench.chat import PROMPT_SETS
from celeris.bench.run import next_token_params


def timed(clock: dict, key: str, fn):  # noqa: ANN001, ANN201 - wraps any callable
    def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[key] += time.perf_counter() - start
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-set", default="mt-bench")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM()
    clock: dict = defaultdict(float)
    model = llm.model
    for name in ("forward", "layout_hidden_states", "logits"):  # the runner's eager entries look these up per call
        setattr(model, name, timed(clock, "target passes", getattr(model, name)))
    llm.proposer.propose_draft_vocab = timed(clock, "drafter calls", llm.proposer.propose_draft_vocab)
    llm.engine.step = timed(clock, "steps", llm.engine.step)
    base = llm.default_params(max_tokens=args.max_tokens, temperature=0.0)
    plain = next_token_params(base)
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": t}])
               for t in PROMPT_SETS[args.prompt_set]()[: args.num_prompts]]
    print(f"{args.prompt_set}, {args.num_prompts} prompts, {args.max_tokens} tokens, {args.threads} thread(s)")
    print("| decoding | steps | tokens | step us | target passes us | drafter us | rest us | rest / step |")
    print("|---|---|---|---|---|---|---|---|")
    for label, params in (("next-token", plain), ("default (verified)", base)):
        llm.generate(prompts[:1], params)  # warm-up
        clock.clear()
        steps = tokens = 0
        for p in prompts:
            out = llm.generate([p], params)[0]
            steps += out.steps
            tokens += len(out.token_ids)
        per = {k: v / steps * 1e6 for k, v in clock.items()}
        rest = per["steps"] - per.get("target passes", 0) - per.get("drafter calls", 0)
        print(f"| {label} | {steps} | {tokens} | {per['steps']:.0f} | {per.get('target passes', 0):.0f} | "
              f"{per.get('drafter calls', 0):.0f} | {rest:.0f} | {rest / per['steps']:.1%} |")


if __name__ == "__main__":
    main()
