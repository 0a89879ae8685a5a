"""Issue 48's route table: milliseconds of one cached SmolLM2 pass (logits included, 128 cached tokens; the bench's
``pass_cost_ms``) at widths 1/2/4/8/16 for each route to a fast CPU pass, at the thread count given:

- ``float32``: the GGUF dequantized to float32, oneDNN-prepacked linears (Celeris's default before the block kernel);
- ``int4-int8``: ``--quantization gguf`` as it was (the file's Q4_1 as group-32 int4 for PyTorch's int4 kernel,
  Q8_0 requantized per channel to int8, bfloat16 activations);
- ``blocks``: the file's own blocks through the C block kernel, PyTorch's small operators between them;
- ``blocks+ops``: the same with the C operators (RMSNorm, silu * up, RoPE + cache write + attention), module by
  module;
- ``blocks+layer``: the same with each decoder layer in one kernel call (``Block.fused``): the product.

    python scripts/pass_routes.py --threads 1 --batch 1 [--routes blocks+ops,blocks+layer]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from celeris.bench.run import pass_cost_ms
from celeris.llm import LLM
from celeris.models import gguf_quantized

ROUTES = ("float32", "int4-int8", "blocks", "blocks+ops", "blocks+layer")


def set_fast(model: torch.nn.Module, on: bool, fused: bool = False) -> None:
    for module in model.modules():
        if hasattr(module, "fast"):
            module.fast = on
        if hasattr(module, "fused"):
            module.fused = fused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--routes", default=",".join(ROUTES), help="comma-separated, of " + ", ".join(ROUTES))
    args = ap.parse_args()
    routes = args.routes.split(",")
    torch.set_num_threads(args.threads)
    widths = tuple(int(w) for w in args.widths.split(","))
    rows = {}
    with torch.no_grad():
        if "float32" in routes:
            rows["float32"] = pass_cost_ms(LLM("smollm2-135m-instruct").model, widths, 128, args.repeats, args.batch)
        if "int4-int8" in routes:
            kinds = gguf_quantized.BLOCK_TYPES
            gguf_quantized.BLOCK_TYPES = {}  # the old layout, converted into a temporary cache (keyed apart)
            with tempfile.TemporaryDirectory() as tmp:
                old_cache, os.environ["CELERIS_CACHE"] = os.environ.get("CELERIS_CACHE"), tmp
                try:
                    rows["int4-int8"] = pass_cost_ms(LLM("smollm2-135m-instruct", quantization="gguf").model, widths,
                                                     128, args.repeats, args.batch)
                finally:
                    gguf_quantized.BLOCK_TYPES = kinds
                    if old_cache is None:
                        os.environ.pop("CELERIS_CACHE")
                    else:
                        os.environ["CELERIS_CACHE"] = old_cache
        model = LLM("smollm2-135m-instruct", quantization="gguf").model
        for name, fast, fused in (("blocks", False, False), ("blocks+ops", True, False), ("blocks+layer", True, True)):
            if name in routes:
                set_fast(model, fast, fused)
                rows[name] = pass_cost_ms(model, widths, 128, args.repeats, args.batch)
    print(json.dumps({"threads": args.threads, "batch": args.batch, "ms": rows}))
    print(f"| route | {' | '.join(f'w={w}' for w in widths)} |")
    print(f"|---|{'---|' * len(widths)}")
    for name, ms in rows.items():
        print(f"| {name} | {' | '.join(f'{ms[str(w)]:.1f}' for w in widths)} |")


if __name__ == "__main__":
    main()
