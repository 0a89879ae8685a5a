"""The embedded hybrid model's decodings side by side: next-token, verified, and plain block diffusion.

    python scripts/hybrid_block_mode.py [--prompts HumanEval.jsonl.gz] [--num 40]

Prints, per system, output tokens/s, tokens per forward pass (every pass counted), HumanEval parse rate
(``celeris.bench.quality``) and position-wise token agreement with next-token decoding, at temperature 0,
128 tokens, batch 8, through ``LLM.engine``.
"""

from __future__ import annotations

import argparse
import time

from celeris.bench.quality import cut_function_body, has_code, heal_prompt, load_humaneval, parses
from celeris.llm import LLM

SYSTEMS = {
    "next-token": {"decoding": "fixed", "block_length": 1, "steps": 128},
    "verified": {"decoding": "verified"},
    "block4-threshold0.9": {"decoding": "threshold", "threshold": 0.9, "block_length": 4, "cache": "none"},
    "block4-low_confidence_dynamic0.9": {"decoding": "low_confidence_dynamic", "threshold": 0.9, "block_length": 4,
                                         "steps": 4, "cache": "none"},
    "block4-threshold0.7": {"decoding": "threshold", "threshold": 0.7, "block_length": 4, "cache": "none"},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", help="HumanEval JSONL(.gz) (default: the set shipped in celeris/data)")
    p.add_argument("--num", type=int, default=40)
    p.add_argument("--model", default="celeris-code-6m-hybrid")
    args = p.parse_args()
    llm = LLM(args.model, device="cpu", max_batch_size=8)
    texts = [heal_prompt(q["prompt"]) for q in load_humaneval(args.prompts)[: args.num]]
    ids = [llm.tokenizer.encode(t)[-380:] for t in texts]
    base = None
    for name, settings in SYSTEMS.items():
        params = llm.default_params(max_tokens=128, temperature=0.0, **settings)
        start, outs = time.perf_counter(), []
        for i in range(0, len(ids), 8):
            requests = [llm.engine.add_request(q, params) for q in ids[i : i + 8]]
            while llm.engine.has_unfinished():
                llm.engine.step()
            outs += [llm.to_output("", r) for r in requests]
        seconds = time.perf_counter() - start
        tokens, nfe = sum(len(o.token_ids) for o in outs), sum(o.nfe for o in outs)
        parse = sum(has_code(b) and parses(t + b) for t, b in
                    zip(texts, (cut_function_body(o.text) for o in outs), strict=True)) / len(texts)
        base = base or [o.token_ids for o in outs]
        agree = sum(sum(a == b for a, b in zip(o.token_ids, r, strict=False)) / max(1, len(r))
                    for o, r in zip(outs, base, strict=True)) / len(outs)
        print(f"{name:34s} tokens/s {tokens / seconds:7.1f}  tokens/forward {tokens / nfe:.2f}  parse {parse:.3f}  "
              f"agreement with next-token {agree:.3f}")


if __name__ == "__main__":
    main()
