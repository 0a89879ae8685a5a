"""Is verified decoding (the default's drafts, batch 1) lossless against the same target's next-token decoding
when the target's weights are quantized? Greedy answers of both on the chat bench's first prompts, and each
answer that differs with the target's top-2 logit gap at the first differing position (``celeris.bench.chat``'s
``mismatches``; a full pass over prompt + answer so far).

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/verified_vs_next_token.py --quantization int4

``--invariance`` instead prints how far the quantized kernels' rows and the attention's last query move with the
number of rows (queries) in a call: the candidates for a path difference. ``docs/quantization.md`` ("Verified
decoding of a quantized target") quotes both. Timings are one pass each, no rounds:
side by side, not a benchmark.
"""

from __future__ import annotations

import argparse
import time

import torch

from celeris import LLM
from celeris.bench.chat import POLICY, PROMPT_SETS, mismatches, systems
from celeris.llm import DEFAULT_MODEL


@torch.no_grad()
def invariance() -> None:
    """Largest difference between one call over many rows and the same rows one at a time: int4 and int8 weight-only
    kernels (SmolLM2's qkv shape, random codes, bfloat16 activations), and scaled_dot_product_attention's last query
    alone against 40 queries (float32, SmolLM2's 9 query and 3 key-value heads of 64, 100 keys)."""
    from celeris.models.quantize import int4_scales_and_zeros

    torch.manual_seed(0)
    n, k = 960, 576
    x = torch.randn(80, k).bfloat16()
    w4 = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
    table = int4_scales_and_zeros(torch.rand(n, k // 32) * 0.01, torch.randn(n, k // 32) * 0.01, torch.bfloat16)
    w8, scales = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16() * 0.01
    for name, mm in (("int4", lambda a: torch._weight_int4pack_mm_for_cpu(a, w4, 32, table)),
                     ("int8", lambda a: torch._weight_int8pack_mm(a, w8, scales))):
        rows = torch.cat([mm(x[i : i + 1]) for i in range(len(x))])
        print(f"{name} kernel, 80 rows in one call against one by one: max |diff| {(rows - mm(x)).abs().max().item()}")
    q, keys, values = torch.randn(1, 9, 40, 64), torch.randn(1, 9, 100, 64), torch.randn(1, 9, 100, 64)
    last = torch.nn.functional.scaled_dot_product_attention(q[:, :, -1:], keys, values)
    every = torch.nn.functional.scaled_dot_product_attention(q, keys, values)[:, :, -1:]
    print(f"attention, the last query alone against 40 queries: max |diff| {(last - every).abs().max().item():.3g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantization", default="float32", help="float32 (none), int8, int4, gguf")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--invariance", action="store_true", help="only the kernels' and attention's row invariance")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.invariance:
        return invariance()
    llm = LLM(str(DEFAULT_MODEL), **({} if args.quantization == "float32" else {"quantization": args.quantization}))
    for name in ("mt-bench", "gsm8k"):
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": t}])
                   for t in PROMPT_SETS[name]()[: args.num_prompts]]
        answers = {}
        for system, params, policy in systems(llm, args.max_tokens):
            if system not in ("target-next-token", "default"):
                continue
            for key, value in zip(POLICY, policy or (None,) * len(POLICY), strict=True):
                setattr(llm.proposer, key, value)
            llm.generate(prompts[:1], params)  # warm-up
            start, outs = time.perf_counter(), []
            for p in prompts:
                outs += llm.generate([p], params)
            seconds = time.perf_counter() - start
            tokens, passes = sum(len(o.token_ids) for o in outs), sum(o.nfe for o in outs)
            answers[system] = [o.token_ids for o in outs]
            print(f"{args.quantization} {name} {system}: {tokens} tokens, {tokens / seconds:.1f} tokens/s, "
                  f"{tokens / passes:.3f} tokens per target pass")
        found = mismatches(llm, prompts, answers["default"], answers["target-next-token"])
        print(f"{args.quantization} {name}: {len(found)} of {len(prompts)} answers differ {found}")


if __name__ == "__main__":
    main()
