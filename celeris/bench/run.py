"""`celeris bench`: speed and quality of decoding systems side by side, under recorded conditions.

Systems (each run on the same HumanEval prompts, same output length, same batch size;
every output length is swept, and every batch size of ``batch_sizes``):

- ``dllm-reference``: the diffusion model with LLaDA's reference sampler: one token per
  denoising step (``steps = max_tokens``), blocks of 32, no cache, no early exit;
- ``dllm-fast``: the diffusion model with the model's default settings
  (``generation_config.json``, its steps scaled with the length; for the embedded model: one
  token per step, blocks of 8, the ``dual_delayed`` KV cache), or with ``ceil(length /
  fast_tokens_per_step)`` steps and ``fast_suffix_window`` when given;
- for a hybrid model (``draft_block_size`` > 0, ``celeris train --objective hybrid``) the two systems
  above are replaced by ``hybrid-next-token`` (its own greedy next-token decoding with a KV cache, the
  reference its verified output must equal) and ``hybrid-verified`` (``decoding="verified"`` through the
  engine; the run also records the acceptance rate per draft slot, over its warm-up and timed calls),
  and, beside the twin, ``ar-twin-lookup`` (the twin under verified decoding with prompt-lookup drafts
  only: what the mask slots add over lookup alone);
- for a block-diffusion model (SDAR, Fast-dLLM v2: ``celeris.models.contract``) the two systems are
  ``block-reference`` (its reference sampler, ``celeris.reference.block.generate_block``: the whole canvas
  recomputed every step, no cache) and ``block-engine`` (the engine's block path: exact KV cache of the
  history), both with the model's default decoding settings at temperature 0; they give the same tokens
- ``ar-twin``: an autoregressive model of the same architecture (``--ar-model``),
  decoded token by token with a KV cache;
- ``smollm2-135m``: SmolLM2-135M-Instruct through ``transformers`` ``generate`` (greedy), what a
  CPU user would pick instead, when its optional weights are installed (``celeris.bench.smollm2``);
  otherwise a note in the results says why it was skipped. Its tokens are its own tokenizer's.

What is timed: submit to full answer of a batch (``time.perf_counter``), after
``warmup`` untimed batches; the first (cold) request is timed separately including
the model load. Output tokens/s counts only returned tokens (up to the first
end-of-text), never prompt or padding. TTFT is when the answer's first token was
final. Peak RSS is the process's peak resident set size over each system's calls
(reset before each system on Linux; it includes every model the process has loaded).

Quality beside speed: share of completions that parse (``celeris.bench.quality``),
share with a run of more than 8 identical tokens, token agreement of each system with
the reference at temperature 0 (position-wise, over the reference's length), and,
generative perplexity of each system's output text under a judge: SmolLM2-135M when
installed (``n/a`` for SmolLM2's own systems: the baseline, or a SmolLM2 ``--model``: it would judge its own
text), else the AR twin (same tokenizer only).
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from celeris.bench import smollm2
from celeris.bench.quality import cut_function_body, has_code, heal_prompt, load_humaneval, max_repeat_run, parses
from celeris.bench.quantized import load_width, parse_widths, width_report
from celeris.llm import LLM
from celeris.models.layers import KVCache
from celeris.models.quantize import quantization_of
from celeris.reference.autoregressive import generate_autoregressive
from celeris.reference.block import generate_block
from celeris.sampling.block import contract_of
from celeris.sampling.params import SamplingParams
from celeris.sampling.verified import draft_length


@dataclass(slots=True)
class BenchConfig:
    """Fixed conditions of one benchmark run (all recorded in the JSON output)."""

    model: str | None = None
    ar_model: str | None = None
    lengths: list[int] = field(default_factory=lambda: [64, 128, 256])
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    num_prompts: int = 8
    warmup: int = 1
    prompts: str | None = None  # a HumanEval JSONL(.gz) file; None: the set shipped in celeris/data
    out_dir: str = "bench-results"
    smollm2: bool = True  # add SmolLM2-135M (system and judge) when its weights are installed
    # dllm-fast with steps = ceil(length / K) instead of the model's steps (None: the model's)
    fast_tokens_per_step: int | None = None
    fast_suffix_window: int | None = None  # dllm-fast with this SamplingParams.suffix_window (None: the model's)
    dtype: str | None = None  # weights of the diffusion model and the twin (None: LLM's default for the device)
    max_model_len: int | None = None  # of the model and the twin (LLM's max_model_len; None: the model's, capped)
    tokenizer: str | None = None  # replaces the model's and the twin's tokenizer (LLM's ``tokenizer``)
    chat_template: str | None = None  # replaces their chat template (LLM's ``chat_template``)
    speculative_config: str | None = None  # a DFlash drafter beside the target (LLM's ``speculative_config``)
    # comma-separated widths benched beside the model (celeris.bench.quantized: bfloat16, int8, int4, ...)
    quantization: str | None = None
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        parse_widths(self.quantization)
        if not self.batch_sizes or min(self.batch_sizes) < 1 or self.num_prompts < 1 or self.warmup < 0:
            raise ValueError("batch sizes and num_prompts must be >= 1 and warmup >= 0")
        if self.fast_tokens_per_step is not None and self.fast_tokens_per_step < 1:
            raise ValueError(f"fast tokens per step must be >= 1, got {self.fast_tokens_per_step}")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError("output lengths must be >= 1")


def next_token_params(params: SamplingParams) -> SamplingParams:
    """``params`` with ``SamplingParams``' own default ``decoding`` (a causal model decodes it token by token, no
    drafts): the target-next-token system beside a model whose defaults are verified decoding."""
    return replace(params, decoding=SamplingParams.__dataclass_fields__["decoding"].default)


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set size (Linux >= 4.0: ``5`` to ``/proc/self/clear_refs``).

    Returns False where that is not possible; ``peak_rss_mb`` then stays the peak since start.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB: ``VmHWM`` (reset by ``reset_peak_rss``), else ``ru_maxrss``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 1024  # bytes on macOS, KiB on Linux


def conditions(cfg: BenchConfig, llm: LLM, prompt_lengths: list[int]) -> dict:
    return {
        "config": asdict(cfg), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch."),
        "prompt_tokens": {"min": min(prompt_lengths), "p50": statistics.median(prompt_lengths),
                          "max": max(prompt_lengths)},
        "timing": "perf_counter, submit to full answer per batch, after warm-up batches",
        "peak_rss": "the process's peak RSS (VmHWM, else ru_maxrss) over each system's calls, all loaded models "
                    "included; a run's peak_rss_reset says whether the peak was reset before its calls",
        "generation_config": llm.generation_config,
    }


def run_system(name: str, decode, batches: list[list[int]], warmup: int,
               before_timed: Callable[[], object] | None = None) -> dict:
    """Time ``decode(batch) -> (token_id lists, nfe per request, ttft per request)`` over all batches.

    The first warm-up call is timed on its own (``first_request_s``: caches and allocations are cold).
    ``before_timed`` runs after the warm-up, before the timed calls (the engine's ``reset_prefix_cache``: the
    warm-up's prompts, and a previous system's or round's, must not be timed from cached keys/values, which
    llama.cpp never has; prompts of earlier batches in the timed run may still share blocks,
    e.g. a chat template's system prompt, as in serving).
    ``peak_rss_mb`` is the process's peak over this system's calls where it can be reset (``reset_peak_rss``):
    the models already loaded plus what this system allocates; else the process's peak since start.
    """
    reset = reset_peak_rss()
    first_s = None
    for batch in batches[:warmup]:
        start = time.perf_counter()
        decode(batch)
        first_s = first_s if first_s is not None else time.perf_counter() - start
    if before_timed is not None:
        before_timed()
    outputs, latencies, ttfts, nfes = [], [], [], []
    for batch in batches:
        start = time.perf_counter()
        ids, nfe, ttft = decode(batch)
        latencies.append(time.perf_counter() - start)
        outputs += ids
        nfes += nfe
        ttfts += [t for t in ttft if t is not None]
    tokens = sum(len(o) for o in outputs)
    seconds = sum(latencies)
    return {
        "system": name, "outputs": outputs, "output_tokens": tokens, "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
        "latency_p50_s": round(statistics.median(latencies), 4),
        "latency_p95_s": round(sorted(latencies)[min(len(latencies) - 1, math.ceil(0.95 * len(latencies)) - 1)], 4),
        "ttft_mean_s": round(statistics.mean(ttfts), 4) if ttfts else None,
        "nfe_mean": round(statistics.mean(nfes), 2), "tokens_per_forward": round(tokens / max(sum(nfes), 1), 3),
        "peak_rss_mb": round(peak_rss_mb(), 1), "peak_rss_reset": reset,
        "first_request_s": round(first_s, 4) if first_s is not None else None,
    }


@torch.no_grad()
def pass_cost_ms(model: torch.nn.Module, widths: tuple[int, ...] = (1, 4, 8, 16), prefix: int = 128,
                 repeats: int = 20, batch: int = 1, runner: object | None = None) -> dict[str, float]:
    """Median milliseconds of one cached forward pass (logits included) of ``w`` new columns after a
    ``prefix``-token KV cache, per width: what a decoding step costs against how many columns it computes
    (a next-token step computes 1; a verified step 1 + drafts + mask slots), for ``batch`` rows. With ``runner``
    (an engine's ``ModelRunner``) the passes go through its entries: compiled ones when the engine compiles."""
    device = next(model.parameters()).device
    hidden_states = model.hidden_states if runner is None else runner.hidden_states
    logits = model.logits if runner is None else runner.logits
    length = prefix + max(widths)
    ids = torch.randint(3, model.config.vocab_size, (batch, length), device=device)
    cache = KVCache()
    hidden_states(ids, None, cache)  # fills the cache for every column
    out = {}
    for w in widths:
        times = []
        for _ in range(repeats + 2):
            start = time.perf_counter()
            logits(hidden_states(ids, None, cache, (prefix, prefix + w)))
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the pass has run, not only been queued
            times.append(time.perf_counter() - start)
        out[str(w)] = round(1000 * statistics.median(times[2:]), 3)
    return out


def draft_counts(llm: LLM) -> list[tuple[int, int]]:
    """(drafts checked, drafts accepted) per draft position so far in ``llm``'s engine (none before its first
    verified request)."""
    stats = llm.engine.stats()
    return list(zip(stats.drafted, stats.accepted, strict=True))


def agreement(candidate: list[list[int]], reference: list[list[int]]) -> float:
    """Position-wise share of the reference's tokens that the candidate reproduces."""
    same = total = 0
    for c, r in zip(candidate, reference, strict=True):
        total += len(r)
        same += sum(a == b for a, b in zip(c, r, strict=False))
    return round(same / max(total, 1), 4)


@torch.no_grad()
def perplexity(ar: LLM, prompts: list[list[int]], outputs: list[list[int]]) -> float | None:
    """Generative perplexity: exp(mean NLL of the output tokens given the prompt) under the AR model."""
    nll = count = 0.0
    for p, o in zip(prompts, outputs, strict=True):
        if not o:
            continue
        ids = torch.tensor([(p + o)[-ar.context_length :]], device=ar.device)
        logits = ar.model.logits(ar.model.hidden_states(ids)[0, :-1]).log_softmax(-1)  # (L-1, V): next token
        targets = ids[0, 1:]
        lp = logits.gather(-1, targets[:, None])[-len(o) :, 0]
        nll -= float(lp.sum())
        count += len(o)
    return round(math.exp(nll / count), 3) if count else None


def block_reference(llm: LLM, params: SamplingParams):
    """A block-diffusion model's reference sampler (``celeris.reference.block.generate_block``: recomputes the
    canvas every step, no KV cache) as a bench system; one row at a time, as it decodes them."""
    def decode(batch):
        outs = [generate_block(llm.model, [p], params, llm.end_token_ids) for p in batch]
        return [o.token_ids[0] for o in outs], [o.nfe for o in outs], [o.ttft_s[0] for o in outs]
    return decode


def next_token_system(model: torch.nn.Module, length: int) -> Callable:
    """The reference next-token decoding of ``model`` (greedy, KV cache, one token per pass) as a bench system:
    a batch of prompt ids -> (token ids, nfe, ttft_s) per prompt."""
    def decode(batch):
        out = generate_autoregressive(model, batch, SamplingParams(max_tokens=length))
        return out.token_ids, [out.nfe] * len(batch), out.ttft_s
    return decode


def engine_system(params: SamplingParams, owner: LLM) -> Callable:
    """``owner``'s engine decoding a batch with ``params`` as a bench system (every request added, then steps
    until none is left)."""
    def decode(batch):
        reqs = [owner.engine.add_request(p, params) for p in batch]
        while owner.engine.has_unfinished():
            owner.engine.step()
        outs = [owner.to_output("", r) for r in reqs]
        return [o.token_ids for o in outs], [o.nfe for o in outs], [o.ttft_s for o in outs]
    return decode


def smollm2_system(smol: tuple, llm: LLM, length: int) -> Callable:
    """SmolLM2-135M (``celeris.bench.smollm2``) on the prompts as ``llm``'s tokenizer decodes them."""
    def decode(batch):
        ids, nfe, ttft = smollm2.generate_hf(*smol, [llm.tokenizer.decode(p) for p in batch], length)
        return ids, nfe, [ttft] * len(batch)
    return decode


def plan_systems(owner: LLM, length: int, fast: SamplingParams, reference: SamplingParams,
                 hybrid: bool) -> tuple[list, SamplingParams]:
    """The systems a model is benched with at one length, by its kind, and the params of its fast one: a hybrid
    model's verified decoding against its own next-token decoding; a next-token model's reference, engine and
    prompt lookup; a block model's reference sampler and engine; else dllm-reference and dllm-fast."""
    if hybrid:  # verified decoding against the model's own next-token decoding
        fast = owner.default_params(max_tokens=length, temperature=0.0, decoding="verified")
        return [("hybrid-next-token", next_token_system(owner.model, length)),
                ("hybrid-verified", engine_system(fast, owner))], fast
    if getattr(owner.model.config, "is_causal", False) and contract_of(owner.model) is None:
        # a next-token model (Llama, Qwen2, Qwen3, the twin): the reference sampler, the engine, prompt lookup
        engine = owner.default_params(max_tokens=length, temperature=0.0)
        lookup = owner.default_params(max_tokens=length, temperature=0.0, decoding="verified", draft_source="lookup")
        return [("ar-reference", next_token_system(owner.model, length)), ("ar-engine", engine_system(engine, owner)),
                ("ar-lookup", engine_system(lookup, owner))], engine
    if contract_of(owner.model) is not None:  # a block model: its reference sampler, then the engine
        fast = owner.default_params(max_tokens=length, temperature=0.0)
        return [("block-reference", block_reference(owner, fast)), ("block-engine", engine_system(fast, owner))], fast
    return [("dllm-reference", engine_system(reference, owner)), ("dllm-fast", engine_system(fast, owner))], fast


def load_bench_models(cfg: BenchConfig) -> tuple[LLM, float, dict[str, LLM], LLM | None]:
    """The model (and its load seconds), one copy per other weight width, and the AR twin.

    Raises:
        ValueError: as ``run_bench``.
    """
    load_start = time.perf_counter()
    overrides = {"tokenizer": cfg.tokenizer, "chat_template": cfg.chat_template, "max_model_len": cfg.max_model_len}
    llm = LLM(cfg.model, max_num_seqs=max(cfg.batch_sizes), dtype=cfg.dtype, **overrides)
    load_s = time.perf_counter() - load_start  # cold request = load_s + first_request_s
    widths = {w: load_width(w, lambda **o: LLM(cfg.model, max_num_seqs=max(cfg.batch_sizes),
                                                **{"dtype": cfg.dtype, **overrides, **o}), cfg.quantize_lm_head)
              for w in parse_widths(cfg.quantization)}
    ignored = [flag for flag, value in (("--fast-tokens-per-step", cfg.fast_tokens_per_step),
                                        ("--fast-suffix-window", cfg.fast_suffix_window)) if value is not None]
    if ignored and contract_of(llm.model) is not None:  # block and hybrid models run other systems than dllm-fast
        raise ValueError(f"{' and '.join(ignored)} set the dllm-fast system of a full-attention model; this "
                         f"block-diffusion model is benchmarked with its own defaults (block-reference / "
                         f"block-engine, or hybrid-verified): leave {'them' if len(ignored) > 1 else 'it'} out")
    ar = LLM(cfg.ar_model, max_num_seqs=max(cfg.batch_sizes), dtype=cfg.dtype, **overrides) if cfg.ar_model else None
    probe = "def f(x):\n    return x  # probe"
    if ar is not None and (ar.model.config.vocab_size != llm.model.config.vocab_size
                           or ar.tokenizer.encode(probe) != llm.tokenizer.encode(probe)):
        raise ValueError(f"the autoregressive twin {cfg.ar_model} must use the diffusion model's tokenizer")
    return llm, load_s, widths, ar


def score_run(r: dict, llm: LLM, smol: tuple | None, ar: LLM | None, texts: list[str], prompt_ids: list[list[int]],
              reference_outputs: list[list[int]]) -> None:
    """Add a run's quality figures in place: HumanEval parse rate, repetition share, agreement with the first
    system, and the judge's perplexity (SmolLM2's, else the AR twin's, else none)."""
    own_tokens = r["system"] != "smollm2-135m"  # the diffusion model's tokenizer
    decoded = [(llm.tokenizer if own_tokens else smol[1]).decode(o) for o in r["outputs"]]
    bodies = [cut_function_body(d) for d in decoded]
    r["parse_rate"] = round(sum(has_code(b) and parses(t + b) for t, b in zip(texts, bodies, strict=True))
                            / len(texts), 4)
    r["repetition_share"] = round(sum(max_repeat_run(o) > 8 for o in r["outputs"]) / len(texts), 4)
    r["agreement_with_reference"] = agreement(r["outputs"], reference_outputs) if own_tokens else None
    if smol is not None and (not own_tokens or smollm2.is_smollm2(llm)):
        r["judge_perplexity"] = "n/a"  # SmolLM2 would judge its own text
    elif smol is not None:
        prompt_texts = [llm.tokenizer.decode(p) for p in prompt_ids]  # as truncated for the context window
        r["judge_perplexity"] = smollm2.judge_perplexity(*smol, prompt_texts, decoded)
    else:
        r["judge_perplexity"] = perplexity(ar, prompt_ids, r["outputs"]) if ar and own_tokens else None


def run_systems(systems: list, batches: list, llm: LLM, warmup: int, engines: list[LLM] | None = None) -> list[dict]:
    """Each system over the batches (``run_system``), with the draft acceptance per position of hybrid-verified.
    Every engine the systems run on (``llm`` and ``engines``: the other widths', the twin's) has its prefix cache
    emptied after each system's warm-up."""
    runs = []
    owners = [llm, *(engines or [])]

    def reset() -> None:
        for owner in owners:
            owner.reset_prefix_cache()

    for name, fn in systems:
        before = draft_counts(llm)
        runs.append(run_system(name, fn, batches, warmup, reset))
        if name == "hybrid-verified":  # acceptance per draft position over this system's calls
            after = draft_counts(llm)
            before = before or [(0, 0)] * len(after)  # the drafter was made by this system's first call
            runs[-1]["draft_acceptance"] = [round((a - a0) / (d - d0), 4) if d > d0 else None
                                            for (d0, a0), (d, a) in zip(before, after, strict=True)]
    return runs


def add_width_reports(results: dict, llm: LLM, widths: dict[str, LLM], cfg: BenchConfig, texts: list[str],
                      hybrid: bool) -> None:
    """``results["widths"]``: quality (against this model unquantized, on the first prompts) and pass cost of every
    other weight width, with their warnings in ``results["notes"]``; a model loaded quantized by default (the code
    models' q8_0 on a CPU) is measured as one of them, against its float weights loaded beside it."""
    room = llm.context_length - cfg.lengths[0]
    quality_prompts = [llm.tokenizer.encode(t)[-room:] for t in texts]
    reference, method = llm, quantization_of(llm.model)
    if method is not None:
        reference = LLM(cfg.model, quantization="none", dtype=cfg.dtype, tokenizer=cfg.tokenizer,
                        chat_template=cfg.chat_template, max_model_len=cfg.max_model_len)
        widths = {method: llm, **widths}
    results["widths"] = {}
    for width, other in widths.items():
        report, warning = width_report(reference, other, width, quality_prompts,
                                       fast_quality_params(reference, cfg, hybrid),
                                       lambda m: pass_cost_ms(m.model, runner=m.engine.runner))
        results["widths"][width] = report
        if warning:
            results["notes"].append(warning)
    results["widths"]["reference"] = {"pass_cost_ms_by_width": pass_cost_ms(reference.model) if method else
                                      results.get("pass_cost_ms_by_width") or pass_cost_ms(llm.model)}


def run_bench(cfg: BenchConfig) -> dict:
    """Run every system at every output length and batch size; returns the results (also written to ``out_dir``).

    Raises:
        ValueError: the AR twin's tokenizer is not the diffusion model's; ``fast_tokens_per_step`` or
            ``fast_suffix_window`` for a block-diffusion (or hybrid) model, whose systems would ignore them.
    """
    llm, load_s, widths, ar = load_bench_models(cfg)
    problems = load_humaneval(cfg.prompts)[: cfg.num_prompts]
    texts = [heal_prompt(p["prompt"]) for p in problems]
    results: dict = {"conditions": None, "runs": [], "notes": []}
    smol = None
    if cfg.smollm2:
        reason = smollm2.unavailable_reason()
        if reason:
            results["notes"].append(reason)
        else:
            smol = smollm2.load_smollm2(llm.device)
    results["judge"] = "smollm2-135m" if smol else "ar-twin" if ar else None
    hybrid = draft_length(llm.model) > 0
    for length, batch_size in [(n, b) for n in cfg.lengths for b in cfg.batch_sizes]:
        room = llm.context_length - length
        if room < 8:
            results["runs"].append({"max_tokens": length, "batch_size": batch_size,
                                    "skipped": f"context window {llm.context_length} too short"})
            continue
        prompt_ids = [llm.tokenizer.encode(t)[-room:] for t in texts]
        batches = [prompt_ids[i : i + batch_size] for i in range(0, len(prompt_ids), batch_size)]
        results["conditions"] = results["conditions"] or conditions(cfg, llm, [len(p) for p in prompt_ids])
        reference = SamplingParams(max_tokens=length, steps=length, block_length=32, early_exit=False)
        k = cfg.fast_tokens_per_step
        fast = llm.default_params(max_tokens=length, temperature=0.0, steps=-(-length // k) if k else None,
                                  suffix_window=cfg.fast_suffix_window)
        systems = plan_systems(llm, length, fast, reference, hybrid)[0]
        for width, other in widths.items():  # the same systems at each other weight width (celeris.bench.quantized)
            systems += [(f"{name}@{width}", fn) for name, fn in plan_systems(other, length, fast, reference, hybrid)[0]]
        if ar is not None:
            systems.append(("ar-twin", next_token_system(ar.model, length)))
            if hybrid:  # the ablation: the twin with the prompt-lookup half of the drafts
                lookup = SamplingParams(max_tokens=length, block_length=1, decoding="verified",
                                        draft_source="lookup")
                systems.append(("ar-twin-lookup", engine_system(lookup, ar)))
        if smol is not None:
            systems.append(("smollm2-135m", smollm2_system(smol, llm, length)))
        runs = run_systems(systems, batches, llm, cfg.warmup, [*widths.values(), *([ar] if ar is not None else [])])
        for r in runs:
            r["load_s"] = round(load_s, 3)
            score_run(r, llm, smol, ar, texts, prompt_ids, runs[0]["outputs"])
            r["max_tokens"] = length
            r["batch_size"] = batch_size
        results["runs"] += [{k: v for k, v in r.items() if k != "outputs"} for r in runs]
    if hybrid:
        results["pass_cost_ms_by_width"] = pass_cost_ms(llm.model)
    if widths:
        add_width_reports(results, llm, widths, cfg, texts, hybrid)
    write_outputs(results, Path(cfg.out_dir))
    return results


def fast_quality_params(llm: LLM, cfg: BenchConfig, hybrid: bool) -> SamplingParams:
    """The decoding mode the width quality is measured in: the model's default at the first length, greedy
    (verified for a hybrid model)."""
    extra = {"decoding": "verified"} if hybrid else {}
    return llm.default_params(max_tokens=cfg.lengths[0], temperature=0.0, **extra)


def format_table(results: dict) -> str:
    cols = ["system", "max_tokens", "batch_size", "tokens_per_s", "first_request_s", "ttft_mean_s", "latency_p50_s",
            "latency_p95_s", "nfe_mean", "tokens_per_forward", "parse_rate", "repetition_share",
            "agreement_with_reference", "judge_perplexity"]
    rows = [cols] + [[str(r.get(c, "")) for c in cols] for r in results["runs"] if "system" in r]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)


def write_json(results: dict, out: Path) -> None:
    """``out/bench.json``, atomically (a temporary file replaced)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "bench.json.tmp"
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(out / "bench.json")


def write_outputs(results: dict, out: Path) -> None:
    """bench.json and, when matplotlib is installed, its two plots (``write_plots``)."""
    write_json(results, out)
    write_plots(results, out)


def write_plots(results: dict, out: Path) -> None:
    """``out/tokens_per_s.png`` (tokens/s against output length, at the smallest batch size) and
    ``out/tokens_per_s_by_batch.png`` (against batch size, at the longest length); nothing when matplotlib is not
    installed or there are no runs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = [r for r in results["runs"] if "system" in r]
    if not runs:
        return
    sizes = sorted({r["batch_size"] for r in runs})
    lengths = sorted({r["max_tokens"] for r in runs})
    # tokens/s against output length at the smallest batch size; against batch size at the longest length
    for name, x_key, fixed_key, fixed in (("tokens_per_s.png", "max_tokens", "batch_size", sizes[0]),
                                          ("tokens_per_s_by_batch.png", "batch_size", "max_tokens", lengths[-1])):
        fig, ax = plt.subplots(figsize=(6, 4))
        for system in sorted({r["system"] for r in runs}):
            pts = sorted((r[x_key], r["tokens_per_s"]) for r in runs if r["system"] == system and r[fixed_key] == fixed)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=system)
        ax.set_xlabel("output length (tokens)" if x_key == "max_tokens" else "batch size (prompts)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{fixed_key.replace('_', ' ')} {fixed}")
        ax.set_xscale("log", base=2)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
