"""How ``draft_min_gain`` changes the default's work at batch 1: target passes, drafter calls and seconds per gain.

For each value (``none``: the drafter on every prompt-lookup miss) and each probe interval (``probe_every``), the
default model decodes the first ``--num-prompts`` prompts of each chat prompt set one at a time, greedily, and this
prints per set: target passes, drafter calls, drafts verified, tokens per target pass, wall seconds, whether the
answers equal the first value's (they must: the target verifies every draft), and an estimated speed-up over
next-token decoding from counts alone (load-free): ``tokens * c(1) / (passes * c(1) + drafts * slope + calls * d)``,
with c(1) and the slope per extra column from a bench JSON's ``pass_cost_ms_by_width`` (batch 1, widths 1 and 8)
and d = ``--call-cost`` target one-column passes per drafter call (0.132 for the default's int8 drafter,
``scripts/draft_length.py``). Values run in a rotated order per round so load
drifts hit each alike. A development measurement, not a bench: ``celeris bench --rounds`` measures the systems.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/draft_min_gain.py --gains none,0.15,0.25 --probe-every 4,8 \
        --costs docs/bench/chat-gain/bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from celeris.bench.chat import PROMPT_SETS, distinct_2
from celeris.bench.run import draft_counts, next_token_params
from celeris.llm import DEFAULT_MODEL, LLM
from celeris.sampling.drafter import PROBE_EVERY


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, next_token: bool = False) -> dict:
    """Decode ``prompts`` one at a time with the default model's policy (``next_token``: the target's own
    next-token decoding instead, the text the default must equal); counts and seconds. The prefix cache is emptied
    before each prompt, so no prompt's prefill is served by an earlier one's."""
    proposer = llm.proposer
    calls = proposer.calls
    base = llm.default_params(max_tokens=max_tokens, temperature=0.0)
    params = next_token_params(base) if next_token else replace(base, decoding="verified", draft_source="lookup_first")
    before = sum(d for d, _ in draft_counts(llm))
    passes, answers, start = 0, [], time.perf_counter()
    for p in prompts:
        llm.engine.reset_prefix_cache()
        req = llm.engine.add_request(p, llm.fit_max_tokens(params, len(p)))
        while llm.engine.has_unfinished():
            llm.engine.step()
        out = llm.to_output("", req)
        passes += out.nfe
        answers.append(out.token_ids)
    tokens = sum(len(a) for a in answers)
    return {"passes": passes, "calls": proposer.calls - calls, "tokens": tokens,
            "drafts": sum(d for d, _ in draft_counts(llm)) - before,
            "seconds": time.perf_counter() - start, "answers": answers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gains", default="none,0.25")
    ap.add_argument("--prompt-sets", default="mt-bench,gsm8k")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--drafter", help="another drafter folder in the default's speculative_config")
    ap.add_argument("--probe-every", default=str(PROBE_EVERY))
    ap.add_argument("--costs", type=Path, required=True, help="a chat bench's bench.json (pass_cost_ms_by_width)")
    ap.add_argument("--call-cost", type=float, default=0.132)
    ap.add_argument("--next-token", action="store_true",
                    help="also decode next-token (once a round, first): whether each answer equals it, and the time "
                         "ratio (measured, so only on an idle machine)")
    args = ap.parse_args()
    probes = [int(e) for e in args.probe_every.split(",")]
    # without a gain the probe interval does nothing: "none" runs once
    configs = [(None, probes[0]) if g == "none" else (float(g), e) for g in args.gains.split(",")
               for e in (probes[:1] if g == "none" else probes)]
    cost = json.loads(args.costs.read_text())["pass_cost_ms_by_width"]["batch 1"]
    c1, slope = cost["1"], (cost["8"] - cost["1"]) / 7
    spec = None
    if args.drafter:  # the default's pairing with another drafter folder
        pairing = json.loads((DEFAULT_MODEL / "celeris.json").read_text())["speculative_config"]
        spec = pairing | {"model": args.drafter}
    llm = LLM(str(DEFAULT_MODEL), speculative_config=spec)
    print(f"threads {torch.get_num_threads()}, model {llm.name}")
    for name in args.prompt_sets.split(","):
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": t}])
                   for t in PROMPT_SETS[name]()[: args.num_prompts]]
        runs: dict = {c: [] for c in configs}
        plain: list[dict] = []
        for r in range(args.rounds):
            if args.next_token:
                plain.append(run(llm, prompts, args.max_tokens, next_token=True))
            for c in configs[r % len(configs):] + configs[: r % len(configs)]:
                llm.proposer.draft_min_gain, llm.proposer.probe_every = c
                runs[c].append(run(llm, prompts, args.max_tokens))
        first = runs[configs[0]][0]["answers"]
        if plain:
            secs = statistics.median(y["seconds"] for y in plain)
            print(f"{name} next-token: tokens {plain[0]['tokens']} seconds {secs:.1f} "
                  f"({plain[0]['tokens'] / secs:.2f} tokens/s) distinct-2 {distinct_2(plain[0]['answers'])}", flush=True)
        for c in configs:
            x = runs[c][0]
            secs = statistics.median(y["seconds"] for y in runs[c])
            estimate = x["tokens"] * c1 / (x["passes"] * c1 + x["drafts"] * slope + x["calls"] * args.call_cost * c1)
            equal = ""
            if plain:
                same = sum(a == b for a, b in zip(x["answers"], plain[0]["answers"], strict=True))
                ratio = statistics.median(y["seconds"] for y in plain) / secs
                equal = f" equal to next-token {same}/{len(prompts)}, measured {ratio:.3f}x next-token"
            print(f"{name} gain {c[0]} probe every {c[1]}: passes {x['passes']} calls {x['calls']} drafts "
                  f"{x['drafts']} tokens {x['tokens']} tokens/pass {x['tokens'] / x['passes']:.3f} estimate "
                  f"{estimate:.3f}x next-token, seconds {secs:.1f} ({x['tokens'] / secs:.2f} tokens/s) distinct-2 "
                  f"{distinct_2(x['answers'])} same answers {x['answers'] == first}{equal}", flush=True)


if __name__ == "__main__":
    main()
