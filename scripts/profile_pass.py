"""Where one decoding pass of a model spends its time: ``torch.profiler`` over a few passes of one column after a
128-token KV cache (``celeris.bench.run.pass_cost_ms``'s pass), printed by operator (self CPU time), beside the
median unprofiled pass. Run it on an idle machine.

    python scripts/profile_pass.py --model smollm2-135m-instruct --quantization int4 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from celeris.llm import LLM
from celeris.models.layers import KVCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default=None, help="a --quantization method (default: the loaded dtype)")
    ap.add_argument("--quantize-lm-head", action="store_true")
    ap.add_argument("--no-onednn", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=5, help="passes profiled")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    options = {"onednn": not args.no_onednn}
    if args.quantization:
        options.update(quantization=args.quantization, quantize_lm_head=args.quantize_lm_head)
    model = LLM(args.model, **options).model
    ids = torch.randint(3, model.config.vocab_size, (1, 129))
    cache = KVCache()
    with torch.no_grad():
        model.hidden_states(ids, None, cache)

        def one() -> torch.Tensor:
            return model.logits(model.hidden_states(ids, None, cache, (128, 129)))

        for _ in range(3):
            one()
        times = []
        for _ in range(15):
            start = time.perf_counter()
            one()
            times.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.passes):
                one()
    print(f"median pass {1000 * statistics.median(times):.1f} ms (15 passes, unprofiled); profiled over {args.passes}:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
