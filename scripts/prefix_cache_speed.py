"""Next-token decoding's prefill with the engine's prefix cache against without it, one process, alternating.

Three engines on the same loaded SmolLM2 (`LLM`): prefix caching on with the cache emptied before each call
("cold": what a new prompt costs), on with the cache warm ("warm": the same prompts again, as a repeated system
prompt or a conversation's earlier turns are), and off. Each call decodes 1 token (the prefill and first step) of 8
GSM8K questions after the first 300 in the chat template, next-token decoding; best of ``--repeats`` seconds.

    OMP_NUM_THREADS=1 python scripts/prefix_cache_speed.py --threads 1 --questions GSM8K_TEST_JSONL

(``--questions``: GSM8K's test.jsonl, one {"question": ...} per line; the development copy beside the repo.)
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from celeris import LLM
from celeris.bench.run import next_token_params


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--questions", type=Path, required=True, help="GSM8K's test.jsonl")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in args.questions.read_text().splitlines()[300:308]]
    llm = LLM("smollm2-135m-instruct")
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": r["question"]}]) for r in rows]
    params = replace(next_token_params(llm.default_params(temperature=0.0)), max_tokens=1)
    off = LLM("smollm2-135m-instruct", enable_prefix_caching=False)

    def call(which: LLM) -> tuple[float, list[int]]:
        start = time.perf_counter()
        reqs = [which.engine.add_request(p, params) for p in prompts]
        while which.engine.has_unfinished():
            which.engine.step()
        return time.perf_counter() - start, [int(r.answer[0]) for r in reqs]

    call(llm), call(off)  # warm-up
    best: dict[str, float] = {}
    tokens = {}
    for _ in range(args.repeats):
        for name in ("cold", "warm", "off"):
            if name == "cold":
                llm.reset_prefix_cache()
            seconds, tokens[name] = call(off if name == "off" else llm)
            best[name] = min(best.get(name, 1e9), seconds)
    hits = llm.engine.stats()
    print(json.dumps({"threads": args.threads, "prompt_tokens": sum(map(len, prompts)),
                      "best_s": {k: round(v, 4) for k, v in best.items()},
                      "same_first_tokens": tokens["cold"] == tokens["warm"] == tokens["off"],
                      "prefix_cache_queries": hits.prefix_cache_queries, "hits": hits.prefix_cache_hits}))


if __name__ == "__main__":
    main()
