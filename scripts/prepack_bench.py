"""PyTorch's default float32 matmul (``F.linear``) against oneDNN with prepacked weights (celeris.models.prepack), on
SmolLM2-135M's shapes and on whole SmolLM2 passes, in one process, side by side.

Per shape and row count: median ms per call over a ring of weight copies larger than the CPU cache (so each call
streams its weight from memory, as a decoding pass does). Then ``celeris.bench.run.pass_cost_ms`` of
SmolLM2-135M-Instruct (float32; ``LLM(..., onednn=False)`` against the default) by width at batch 1 and 8. Run it
on an idle machine; ``--threads`` sets PyTorch's threads.

    python scripts/prepack_bench.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv 960x576": (960, 576), "gate_up 3072x576": (3072, 576), "down 576x1536": (576, 1536),
          "head 49152x576": (49152, 576)}


def per_call_ms(fn, repeats: int = 15) -> float:  # noqa: ANN001
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def shapes_table(rows: list[int]) -> None:
    print("| shape | rows | F.linear ms | oneDNN ms |\n|---|---|---|---|")
    for name, (out, inp) in SHAPES.items():
        ring = max(2, (256 << 20) // (out * inp * 4))  # copies: 256 MiB, several times the cache
        weights = [torch.randn(out, inp) for _ in range(ring)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        for m in rows:
            x = torch.randn(m, inp)
            plain = per_call_ms(lambda x=x, ws=weights: [F.linear(x, w) for w in ws]) / ring
            fast = per_call_ms(lambda x=x, ps=packed: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                                      for p in ps]) / ring
            print(f"| {name} | {m} | {plain:.3f} | {fast:.3f} |", flush=True)


def passes_table() -> None:
    from celeris.bench.run import pass_cost_ms
    from celeris.llm import LLM

    widths = (1, 2, 4, 8, 16)
    print("\n| matmul | batch | " + " | ".join(f"w={w} ms" for w in widths) + " |\n|---|---|" + "---|" * len(widths))
    models = {"F.linear": LLM("smollm2-135m-instruct", onednn=False).model,
              "oneDNN": LLM("smollm2-135m-instruct").model}
    for batch in (1, 8):
        for name, model in models.items():
            cost = pass_cost_ms(model, widths, repeats=10, batch=batch)
            print(f"| {name} | {batch} | " + " | ".join(f"{cost[str(w)]:.1f}" for w in widths) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8,64")
    ap.add_argument("--no-passes", action="store_true", help="the shapes only (no SmolLM2 needed)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    print(f"threads {args.threads}, torch {torch.__version__}")
    shapes_table([int(r) for r in args.rows.split(",")])
    if not args.no_passes:
        passes_table()


if __name__ == "__main__":
    main()
