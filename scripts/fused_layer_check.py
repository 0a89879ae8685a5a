"""The whole-layer kernel call (``Block.fused``) against the module path on the default: the same tokens, and the
tokens/s of both, alternating in one process (next-token and the default's verified decoding, 3 MT-Bench + 2 GSM8K
prompts, 96 tokens, 1 thread, two rounds).

    python scripts/fused_layer_check.py
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
    layers = list(llm.model.layers)
    print("fused layers:", sum(b.fused for b in layers), "of", len(layers))
    base = llm.default_params(max_tokens=96, temperature=0.0)
    plain = next_token_params(base)
    texts = PROMPT_SETS["mt-bench"]()[:3] + PROMPT_SETS["gsm8k"]()[:2]
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    tokens: dict[tuple[bool, str], list] = {}
    speeds: dict[tuple[bool, str], list[float]] = {}
    for fused in (True, False, True, False):
        for layer in layers:
            layer.fused = fused
        for label, params in (("next-token", plain), ("default", base)):
            llm.generate(prompts[:1], params)  # warm-up
            start = time.perf_counter()
            outs = [llm.generate([p], params)[0] for p in prompts]
            seconds = time.perf_counter() - start
            ids = [o.token_ids for o in outs]
            if tokens.setdefault((fused, label), ids) != ids:
                raise SystemExit(f"fused={fused} {label}: another round gave other tokens")
            speeds.setdefault((fused, label), []).append(sum(map(len, ids)) / seconds)
    for (fused, label), rounds in sorted(speeds.items()):
        print(f"fused={fused} {label}: " + " / ".join(f"{s:.1f}" for s in rounds) + " tokens/s")
    print("next-token fused == module path:", tokens[(True, "next-token")] == tokens[(False, "next-token")])
    print("default == next-token (fused):", tokens[(True, "default")] == tokens[(True, "next-token")])


if __name__ == "__main__":
    main()
