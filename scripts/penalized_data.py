"""Drafter training answers decoded as the default decodes (issue 49): the committed prompts of ``train-data/``
answered again by the default's target in Celeris's engine, with the default's own settings (its chat template,
greedy, ``frequency_penalty`` 0.2, the GGUF fast pass), at a batch of 8 (next-token decoding: the default keeps its
drafter to batch 1, and the drafted text equals the next-token text).

Each answered row is appended to ``--out`` as one JSON line in the committed form (``id``, ``source``, ``messages``,
``answer``, ``prompt_len``, ``ended``, ``generator``, ``ids`` = prompt + answer ids, the end-of-turn id kept where
the answer ended), so ``scripts/drafter_data.py --rebuild`` computes the training features from it. Resumable: an id
already in ``--out`` is skipped; a row is written only once its whole batch is answered.

    OMP_NUM_THREADS=1 python scripts/penalized_data.py --src train-data/dflash-smollm2.jsonl \\
        --out train-data/dflash-smollm2-penalized.jsonl --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

GENERATOR = "celeris-default-next-token"


def answer(llm, rows: list[dict], max_tokens: int) -> list[dict]:  # noqa: ANN001 - celeris.LLM
    """The default's answers to ``rows`` (dicts with ``messages``) in one ``LLM.generate`` batch, in the committed
    row form."""
    params = llm.default_params(max_tokens=max_tokens)
    prompts = [llm.tokenizer.encode_chat(r["messages"]) for r in rows]
    outs = llm.generate(prompts, params)
    end = llm.tokenizer.eos_token_id
    done = []
    for r, p, o in zip(rows, prompts, outs, strict=True):
        ended = o.finish_reason == "stop"
        ids = p + o.token_ids + ([end] if ended else [])
        done.append({"id": r["id"], "source": r["source"], "messages": r["messages"], "answer": o.text,
                     "prompt_len": len(p), "ended": ended, "generator": GENERATOR, "ids": ids})
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, required=True, help="rows whose prompts are answered (JSON lines), or a "
                    "questions file of drafter_data.py --questions-only")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct-dflash")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--limit", type=int, default=0, help="stop after this many rows answered in all (0: every row)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from celeris import LLM

    rows = [json.loads(x) for x in args.src.read_text().splitlines() if x.strip()]
    # a questions file of ``drafter_data.py --questions-only`` (its dropped questions are empty): one-turn prompts
    rows = [r if "messages" in r else {"id": r["id"], "source": "self",
                                       "messages": [{"role": "user", "content": r["question"]}]}
            for r in rows if r.get("messages") or r.get("question")]
    rows = [r for r in rows if len(r["messages"]) == 1]
    done = {json.loads(x)["id"] for x in args.out.read_text().splitlines() if x.strip()} if args.out.is_file() else set()
    todo = [r for r in rows if r["id"] not in done]
    if args.limit:
        todo = todo[: max(0, args.limit - len(done))]
    print(f"{len(done)} answered, {len(todo)} to go", flush=True)
    llm = LLM(args.model)
    # similar prompt lengths in one batch (less padding), within chunks of 64 so the order stays the source's
    order = [r for s in range(0, len(todo), 64)
             for r in sorted(todo[s:s + 64], key=lambda r: len(r["messages"][0]["content"]))]
    start, tokens = time.perf_counter(), 0
    for b in range(0, len(order), args.batch_size):
        batch = answer(llm, order[b:b + args.batch_size], args.max_tokens)
        with args.out.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in batch))
        tokens += sum(len(r["ids"]) - r["prompt_len"] for r in batch)
        hours = (time.perf_counter() - start) / 3600
        print(f"{len(done) + b + len(batch)} answered; {(b + len(batch)) / hours:.0f} rows/h, "
              f"{tokens / hours / 3600:.1f} answer tokens/s", flush=True)


if __name__ == "__main__":
    main()
