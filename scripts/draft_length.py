"""How many drafts a DFlash drafter's pass should verify: fixed counts against a confidence threshold, offline.

On held-out rows (the target's own greedy answers with their features, ``scripts/drafter_data.py``), the drafter's
greedy drafts and their probabilities at every start come from ``celeris.train.dflash.row_drafts``; walking the
answer as DFlash's decoding loop does at temperature 0 (``walk``) gives, per policy, the tokens per target pass and
the drafts verified per pass:

- ``k=N``: verify the first N drafts of every pass (N = 0: next-token decoding, no drafter call);
- ``p>=T``: verify the leading drafts whose probability under the drafter is at least T (up to block_size - 1; as
  transformers' ``assistant_confidence_threshold`` stops the assistant), the drafter called every pass.

The estimated speed-up over next-token decoding is ``tau / (mean over passes of c(1 + drafts) + d) * c(1)``: c(w)
the target's pass cost at w columns from a bench JSON's ``pass_cost_ms_by_width`` (batch 1; linear between the
measured widths), d one drafter call, timed here against the target's one-column pass in the same process
(alternating, medians), so load on the machine scales both. An estimate, not a bench: ``celeris bench`` measures.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/draft_length.py --drafter runs/exp-v3/export \\
        --heldout runs/drafter-heldout --costs docs/bench/chat-default/bench.json [--quantization int8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from celeris.models import prepack
from celeris.models.dflash import DraftKVCache, load_dflash
from celeris.models.quantize import parse_method, quantize_head_rows, quantize_model
from celeris.train.dflash import load_rows, row_drafts, walk

THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def cost_at(costs: dict[str, float], width: float) -> float:
    """The pass cost (ms) at ``width`` columns, linear between the measured widths (clamped at both ends)."""
    points = sorted((int(w), c) for w, c in costs.items())
    for (w0, c0), (w1, c1) in zip(points, points[1:], strict=False):
        if width <= w1:
            return c0 + (c1 - c0) * (max(width, w0) - w0) / (w1 - w0)
    return points[-1][1]


def drafter_ratio(drafter: torch.nn.Module, embed: torch.Tensor, head: torch.Tensor | torch.nn.Module,
                  context: int = 128, repeats: int = 30) -> float:
    """One drafter call (a block after ``context`` cached context features, scored over its draft vocabulary)
    over one target next-token pass after ``context`` cached tokens: medians of alternating timings."""
    from celeris.bench.run import pass_cost_ms
    from celeris.llm import LLM

    target = LLM("smollm2-135m-instruct", device="cpu", dtype="float32").model
    cfg = drafter.config
    feats = torch.randn(1, context, len(cfg.target_layer_ids) * cfg.hidden_size)
    draft, tgt = [], []
    for _ in range(repeats):
        cache = DraftKVCache()
        block = torch.full((1, cfg.block_size), cfg.mask_token_id)
        with torch.no_grad():
            drafter(torch.nn.functional.embedding(block, embed), feats, torch.arange(context + cfg.block_size)[None],
                    cache)  # fills the context
            cache.crop(context)
            start = time.perf_counter()
            hidden = drafter(torch.nn.functional.embedding(block, embed), feats[:, :0],
                             torch.arange(context, context + cfg.block_size)[None], cache)
            drafter.draft_logits(hidden[:, 1:], head).argmax(-1)
            draft.append(time.perf_counter() - start)
        tgt.append(pass_cost_ms(target, (1,), prefix=context, repeats=1)["1"] / 1000)
    return statistics.median(draft) / statistics.median(tgt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", type=Path, required=True)
    ap.add_argument("--heldout", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--costs", type=Path, required=True, help="a bench JSON with pass_cost_ms_by_width")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quantization", help="the drafter's weight-only method (its layers and draft head), as "
                                           "speculative_config's quantization")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from safetensors.torch import load_file

    from celeris.bench.smollm2 import hf_folder

    embed = load_file(hf_folder() / "model.safetensors")["model.embed_tokens.weight"].float()
    drafter = load_dflash(args.drafter).eval()
    head = embed[drafter.d2t] if drafter.d2t.numel() < embed.shape[0] else embed  # the draft vocabulary's rows
    if args.quantization:
        quantize_model(drafter, args.quantization)
        head = quantize_head_rows(head, parse_method(args.quantization), torch.bfloat16, "the drafter's head rows")
    elif prepack.available(torch.device("cpu"), torch.float32):
        prepack.prepack_model(drafter)  # float32 linears through oneDNN, as LLM runs a float drafter (and the target)
    k = drafter.config.block_size - 1
    rows = load_rows(args.heldout, list(drafter.config.target_layer_ids), [1, 15, 27], args.rows)
    drawn = [row_drafts(drafter, embed, r, k, head) for r in rows]
    costs = json.loads(args.costs.read_text())["pass_cost_ms_by_width"]["batch 1"]
    ratio = drafter_ratio(drafter, embed, head)
    print(f"{len(rows)} held-out rows; drafter ({args.quantization or 'float32'}) call / target one-column pass = "
          f"{ratio:.3f} ({args.threads} thread(s)); pass costs (ms, batch 1) {costs} from {args.costs}")
    policies = {f"k={n}": lambda d, c, n=n: torch.full((d.shape[0],), n) for n in range(k + 1)}
    policies |= {f"p>={t}": lambda d, c, t=t: (c >= t).long().cumprod(1).sum(1) for t in THRESHOLDS}
    print(f"{'policy':8s} {'tau':>6s} {'drafts/pass':>11s} {'est. speed-up':>13s}")
    for name, keep_of in policies.items():
        passes = tokens = verified = 0
        ms = 0.0
        for r, (d, c) in zip(rows, drawn, strict=True):
            for n, _, step in walk(r, d, keep_of(d, c)):
                passes, tokens, verified = passes + 1, tokens + step, verified + n
                ms += cost_at(costs, 1 + n) + (0 if name == "k=0" else ratio * cost_at(costs, 1))
        speedup = tokens / passes / (ms / passes) * cost_at(costs, 1)
        print(f"{name:8s} {tokens / passes:6.3f} {verified / passes:11.2f} {speedup:13.3f}")


if __name__ == "__main__":
    main()
