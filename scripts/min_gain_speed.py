"""``draft_min_gain`` timed live: next-token decoding, the default, and the default with draft_min_gain 0.15 and
0.3, alternating in one process for two rounds (the prefix cache emptied before each), on the first 6 MT-Bench and
6 GSM8K prompts, 128 tokens, 1 thread: tokens/s per round and tokens per target pass.

    python scripts/min_gain_speed.py
"""

from __future__ import annotations

import time

import torch

from celeris import LLM
from celeris.bench.chat import PROMPT_SETS
from celeris.bench.run import next_token_params


def main() -> None:
    torch.set_num_threads(1)
    llm = LLM()
    base = llm.default_params(max_tokens=128, temperature=0.0)
    plain = next_token_params(base)
    systems = (("next-token", None, plain), ("default, no min gain", None, base), ("min gain 0.15", 0.15, base),
               ("min gain 0.3", 0.3, base))
    for name in ("mt-bench", "gsm8k"):
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in PROMPT_SETS[name]()[:6]]
        speeds: dict[str, list[float]] = {}
        per_pass: dict[str, float] = {}
        for _ in range(2):
            for label, gain, params in systems:
                llm.proposer.draft_min_gain = gain
                llm.reset_prefix_cache()
                start = time.perf_counter()
                outs = [llm.generate([p], params)[0] for p in prompts]
                tokens = sum(len(o.token_ids) for o in outs)
                speeds.setdefault(label, []).append(tokens / (time.perf_counter() - start))
                per_pass[label] = tokens / sum(o.nfe for o in outs)
        for label, rounds in speeds.items():
            print(f"{name} {label}: {' / '.join(f'{s:.1f}' for s in rounds)} tokens/s, "
                  f"{per_pass[label]:.3f} tokens per target pass")


if __name__ == "__main__":
    main()
