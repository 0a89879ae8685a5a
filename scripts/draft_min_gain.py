"""How ``draft_min_gain`` changes the default's work at batch 1: target passes, drafter calls and seconds per gain.

For each value (``none``: the drafter on every prompt-lookup miss), the default model decodes the first
``--num-prompts`` prompts of each chat prompt set one at a time, greedily, and this prints per set: target passes,
drafter calls, tokens per target pass, drafter tokens accepted per call, wall seconds, and whether the answers equal
the first value's (they must: the target verifies every draft). Values run in a rotated order per round so load
drifts hit each alike. A development measurement, not a bench: ``celeris bench --rounds`` measures the systems.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/draft_min_gain.py --gains none,0.15,0.25,0.4 --num-prompts 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from celeris.bench.chat import PROMPT_SETS
from celeris.llm import DEFAULT_MODEL, LLM


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """Decode ``prompts`` one at a time with the default model's policy; counts and seconds."""
    proposer = llm.proposer
    calls = proposer.calls
    params = replace(llm.default_params(max_tokens=max_tokens, temperature=0.0), decoding="verified",
                     draft_source="lookup_first")
    passes, answers, start = 0, [], time.perf_counter()
    for p in prompts:
        req = llm.engine.add_request(p, llm.fit_max_tokens(params, len(p)))
        while llm.engine.has_unfinished():
            llm.engine.step()
        out = llm.to_output("", req)
        passes += out.nfe
        answers.append(out.token_ids)
    tokens = sum(len(a) for a in answers)
    return {"passes": passes, "calls": proposer.calls - calls, "tokens": tokens,
            "seconds": time.perf_counter() - start, "answers": answers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gains", default="none,0.25")
    ap.add_argument("--prompt-sets", default="mt-bench,gsm8k")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--drafter", help="another drafter folder in the default's speculative_config")
    args = ap.parse_args()
    gains = [None if g == "none" else float(g) for g in args.gains.split(",")]
    spec = None
    if args.drafter:  # the default's pairing with another drafter folder
        pairing = json.loads((DEFAULT_MODEL / "celeris.json").read_text())["speculative_config"]
        spec = pairing | {"model": args.drafter}
    llm = LLM(str(DEFAULT_MODEL), speculative_config=spec)
    print(f"threads {torch.get_num_threads()}, model {llm.name}")
    for name in args.prompt_sets.split(","):
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": t}])
                   for t in PROMPT_SETS[name]()[: args.num_prompts]]
        runs: dict = {g: [] for g in gains}
        for r in range(args.rounds):
            for g in gains[r % len(gains):] + gains[: r % len(gains)]:
                llm.proposer.draft_min_gain = g
                runs[g].append(run(llm, prompts, args.max_tokens))
        first = runs[gains[0]][0]["answers"]
        for g in gains:
            x = runs[g][0]
            accepted = x["tokens"] - x["passes"]  # every pass gives one token of the target's own
            secs = statistics.median(y["seconds"] for y in runs[g])
            print(f"{name} gain {g}: passes {x['passes']} calls {x['calls']} tokens/pass "
                  f"{x['tokens'] / x['passes']:.3f} accepted/call {accepted / max(x['calls'], 1):.3f} "
                  f"seconds {secs:.1f} tokens/s {x['tokens'] / secs:.2f} same answers {x['answers'] == first}",
                  flush=True)


if __name__ == "__main__":
    main()
