"""Issue 48's quality floor for the CPU fast pass: on the bench's answers (MT-Bench and GSM8K prompts, the float32
model's own greedy answers under the default's frequency penalty, teacher-forced), top-1 agreement and mean KL of
``--quantization gguf`` (the GGUF's blocks, the block kernel, the C operators) against Celeris's float32 load of the
same GGUF, beside llama.cpp's own logits (llama-cpp-python's ``logits_all``) on the same tokens, in one run.

    python scripts/fast_pass_quality.py --num-prompts 8 --max-tokens 128 --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import torch

from celeris.bench.chat import PROMPT_SETS
from celeris.llm import LLM
from celeris.models.catalog import ALIASES, package_dir


def compare(ref: torch.Tensor, cand: torch.Tensor) -> tuple[int, float, float]:
    """(tokens, top-1 agreements, summed KL(ref || cand) in nats) over rows of (n, V) logits."""
    lr, lc = ref.float().log_softmax(-1), cand.float().log_softmax(-1)
    kl = (lr.exp() * (lr - lc)).sum(-1)
    return ref.shape[0], float((ref.argmax(-1) == cand.argmax(-1)).sum()), float(kl.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ref = LLM("smollm2-135m-instruct")
    fast = LLM("smollm2-135m-instruct", quantization="gguf")
    from llama_cpp import Llama

    gguf = sorted(package_dir(ALIASES["smollm2-135m-instruct"].package).glob("*.gguf"))[0]
    llama = Llama(str(gguf), n_ctx=4096, n_threads=args.threads, logits_all=True, verbose=False)
    params = dataclasses.replace(ref.default_params(max_tokens=args.max_tokens), frequency_penalty=0.2)
    totals = {name: [0, 0.0, 0.0] for name in ("celeris-gguf", "llama.cpp")}
    per_set = {}
    for set_name in ("mt-bench", "gsm8k"):
        sums = {name: [0, 0.0, 0.0] for name in totals}
        for text in PROMPT_SETS[set_name]()[: args.num_prompts]:
            prompt = ref.tokenizer.encode_chat([{"role": "user", "content": text}])
            answer = ref.generate([prompt], params)[0].token_ids
            ids = prompt + list(answer)
            n = len(prompt)
            with torch.no_grad():  # model(x)[i] scores token i: rows n .. end-1 score the answer
                want = ref.model(torch.tensor([ids]))[0, n:]
                got = fast.model(torch.tensor([ids]))[0, n:]
            llama.reset()
            llama.eval(ids)
            theirs = torch.from_numpy(np.array(llama.scores[n - 1 : len(ids) - 1], dtype=np.float32))  # row i: i+1
            for name, cand in (("celeris-gguf", got), ("llama.cpp", theirs)):
                for acc, part in ((sums[name], compare(want, cand)), (totals[name], compare(want, cand))):
                    for i in range(3):
                        acc[i] += part[i]
        per_set[set_name] = {k: {"tokens": v[0], "top1": round(v[1] / v[0], 4), "mean_kl": round(v[2] / v[0], 5)}
                             for k, v in sums.items()}
    per_set["all"] = {k: {"tokens": v[0], "top1": round(v[1] / v[0], 4), "mean_kl": round(v[2] / v[0], 5)}
                      for k, v in totals.items()}
    print(json.dumps(per_set, indent=1))


if __name__ == "__main__":
    main()
