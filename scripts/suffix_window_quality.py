"""Does the model need the far masked suffix? Quality when each pass sees only W masked columns past the block.

    python scripts/suffix_window_quality.py [--num-prompts 8] [--length 256] [--windows 64,32,16,8]

DPad (arXiv:2508.14148) drops the distant masked suffix of a diffusion LM's canvas. This probe decodes the first
N HumanEval prompts with the embedded model's default decoding (greedy, one token per step, blocks of 8) but no
KV cache, once with the whole canvas and once per W with every pass's canvas cut at the block's end + W, and
reports the perplexity of the answers under the autoregressive twin (``celeris.bench.run.perplexity``), the
position-wise agreement with the whole-canvas answers, the share of answers with a run of more than 8
identical tokens, and the wall time. It changes nothing in the engine (the cut is applied around the model).
"""

from __future__ import annotations

import argparse
import time

import torch

from celeris.bench.quality import heal_prompt, load_humaneval, max_repeat_run
from celeris.bench.run import agreement, perplexity
from celeris.llm import LLM
from celeris.reference.masked import generate


class SuffixCut(torch.nn.Module):
    """Wraps a model: every pass sees the canvas cut ``window`` columns after its ``logits_slice`` (0: no cut)."""

    def __init__(self, model: torch.nn.Module, window: int) -> None:
        super().__init__()
        self.model, self.window, self.config = model, window, model.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                logits_slice: slice | None = None, **kwargs: object) -> torch.Tensor:
        cut = input_ids.shape[1] if not self.window else min(input_ids.shape[1], logits_slice.stop + self.window)
        mask = None if attention_mask is None else attention_mask[:, :cut]
        return self.model(input_ids[:, :cut], mask, logits_slice=logits_slice, **kwargs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--length", type=int, default=256, help="answer tokens")
    p.add_argument("--windows", default="64,32,16,8", help="masked columns kept past the block, comma-separated")
    args = p.parse_args()
    llm, twin = LLM(None, device="cpu"), LLM("celeris-code-6m-ar", device="cpu")
    prompts = [llm.tokenizer.encode(heal_prompt(x["prompt"])) for x in load_humaneval()[: args.num_prompts]]
    params = llm.default_params(max_tokens=args.length, cache="none", early_exit=False, temperature=0.0)
    base = None
    for window in [0] + [int(w) for w in args.windows.split(",")]:
        start = time.perf_counter()
        outs = [generate(SuffixCut(llm.model, window), [ids], params).token_ids[0] for ids in prompts]
        seconds = time.perf_counter() - start
        base = outs if base is None else base
        loops = sum(max_repeat_run(o) > 8 for o in outs) / len(outs)
        print(f"W={window or 'all'}: twin perplexity {perplexity(twin, prompts, outs)}, agreement "
              f"{agreement(outs, base):.0%}, runs > 8: {loops:.0%}, {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main()
