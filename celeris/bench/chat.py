"""`celeris bench --prompt-set mt-bench,gsm8k,summarisation`: a chat model's decoding systems on chat prompts.

Prompt sets (through the model's chat template, one user turn): ``mt-bench`` (MT-Bench's first turns), ``gsm8k``
(GSM8K test questions; the drafter's training data holds out the first 300, which these are drawn from) and
``summarisation`` ("Summarise in one sentence:" and a TinyStories paragraph, from the first 100 paragraphs, which the
drafter's training data holds out too).
Quick runs take the first ``num_prompts`` of each set (the fixed subset).

Systems, each on the same prompts, output length and batch size, all at temperature 0:

- ``target-next-token``: the target's own next-token decoding in the engine (the reference the others must equal);
- ``target-lookup``: verified decoding with prompt-lookup drafts only;
- ``dflash`` and ``dflash-lookup-first`` (with a DFlash drafter, ``--speculative-config`` or a drafter folder):
  verified decoding with the drafter's drafts, with and without prompt lookup first, the drafter on at every
  batch size (prompt lookup too) and on every lookup miss; ``default`` when the drafter's ``disable_by_batch_size``,
  ``lookup_disable_by_batch_size`` or ``draft_min_gain`` switches the drafter or prompt lookup off at some batch size
  or for a request it does not pay on (the default model's own policy);
- ``transformers``: SmolLM2 through transformers' ``generate`` on the same weights (SmolLM2 targets only);
- ``llama.cpp``: llama-cpp-python on the same ``.gguf`` file when it is installed (``celeris.bench.llamacpp``: the
  same prompt ids, greedy, its own quantized kernels; a batch's prompts run one after another), else a note.

Each engine system's timed calls start with the prefix cache emptied (``LLM.reset_prefix_cache``, after the
warm-up): no engine system may take a prompt it saw in the warm-up, a previous system or round from the cache
(llama.cpp is reset before every prompt, so it prefills each in full); blocks its own earlier prompts share, the
chat template's system prompt, still count, for next-token decoding and the verified systems alike (the engine's
one prefix cache: ``prefix_cache_hit_tokens``).

Per system: tokens/s, TTFT, p50/p95 latency, tokens per target pass, drafter passes, acceptance per draft position,
peak RSS, the answers' repetition share (a run of one token longer than 8) and distinct-2, and every greedy text
that differs from ``target-next-token``'s with the float32 top-2 logit gap of the target at its first differing
position (a gap below 1e-4 is a tie). The results resume per (system, prompt set, batch size) from ``bench.json``.
With ``rounds`` above 1 (``--rounds``) every system runs again over the same batches, the order rotated each round,
and its tokens/s is the median over rounds: on these shared 2-core machines one system measured twice in one run
differed by up to 28% (``docs/benchmarks.md``), so a single pass in a fixed order can rank systems by when they ran.
The target's pass cost by width (1, 2, 4, 8, 16 columns after 128 cached tokens) at batch 1 and 8 is recorded.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from celeris.bench import llamacpp, smollm2
from celeris.bench.memory import own_process_memory
from celeris.bench.quality import max_repeat_run
from celeris.bench.quantized import load_width, parse_widths, speed_floor, width_report
from celeris.bench.run import conditions, draft_counts, next_token_params, pass_cost_ms, run_system, write_json
from celeris.data import gsm8k_questions, mt_bench_questions, summarisation_prompts
from celeris.llm import LLM
from celeris.sampling.params import SamplingParams

PROMPT_SETS = {"mt-bench": mt_bench_questions, "gsm8k": gsm8k_questions, "summarisation": summarisation_prompts}


@dataclass(slots=True)
class ChatBenchConfig:
    """Fixed conditions of one chat benchmark run (recorded in the JSON output)."""

    model: str | None = None
    prompt_sets: list[str] = field(default_factory=lambda: list(PROMPT_SETS))
    max_tokens: int = 256
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    num_prompts: int = 24
    warmup: int = 1
    out_dir: str = "bench-results"
    smollm2: bool = True
    llamacpp: bool = True  # add llama.cpp on the same .gguf file when llama-cpp-python is installed
    dtype: str | None = None
    max_model_len: int | None = None
    speculative_config: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    # comma-separated widths benched beside the model (celeris.bench.quantized: bfloat16, int8, int4, ...)
    quantization: str | None = None
    quantize_lm_head: bool = False
    quality_prompts: int = 8  # first prompts of the first set the widths' quality is measured on
    # times every system runs over the same batches, in a rotated order each round, so that a drift of the
    # machine's speed (clock, other jobs, warming caches) does not favour the systems that run last; tokens_per_s
    # is the median over rounds (``tokens_per_s_rounds`` holds each)
    rounds: int = 1
    # each of default, target-next-token and llama.cpp loaded alone in a child process, its peak RSS measured
    # there (celeris.bench.memory), beside the runs' peak of the one process holding every system
    own_process_memory: bool = True

    def __post_init__(self) -> None:
        parse_widths(self.quantization)
        unknown = [s for s in self.prompt_sets if s not in PROMPT_SETS]
        if unknown:
            raise ValueError(f"unknown prompt set(s) {', '.join(unknown)} (known: humaneval, {', '.join(PROMPT_SETS)})")
        if not self.batch_sizes or min(self.batch_sizes) < 1 or min(self.num_prompts, self.max_tokens, self.rounds) < 1:
            raise ValueError("batch sizes, num_prompts, max_tokens and rounds must be >= 1")


PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")


def distinct_2(outputs: list[list[int]]) -> float:
    """Distinct bigrams over all bigrams of the answers (Li et al. 2016, "distinct-n"): 1.0 never repeats."""
    pairs = [(a, b) for o in outputs for a, b in zip(o, o[1:], strict=False)]
    return round(len(set(pairs)) / len(pairs), 4) if pairs else 0.0


@torch.no_grad()
def mismatches(llm: LLM, prompts: list[list[int]], outputs: list[list[int]], reference: list[list[int]]) -> list[dict]:
    """Each answer that differs from the reference's: its index, the first differing position and the target's
    float32 top-2 logit gap there (below 1e-4: a tie that float rounding may break either way)."""
    found = []
    for i, (p, o, r) in enumerate(zip(prompts, outputs, reference, strict=True)):
        j = next((j for j, (a, b) in enumerate(zip(o, r, strict=False)) if a != b), min(len(o), len(r)))
        if o == r:
            continue
        ids = torch.tensor([p + r[:j]], device=llm.device)
        logits = llm.model.logits(llm.model.hidden_states(ids)[0, -1]).float()  # (V,): the next token
        top = logits.topk(2).values
        found.append({"prompt": i, "position": j, "top2_gap": round(float(top[0] - top[1]), 6)})
    return found


Policy = tuple[int | None, int | None, float | None]  # the proposer's (disable_by_batch_size,
# lookup_disable_by_batch_size, draft_min_gain): when it skips the drafter or prompt lookup
POLICY = ("disable_by_batch_size", "lookup_disable_by_batch_size", "draft_min_gain")


def systems(llm: LLM, max_tokens: int) -> list[tuple[str, SamplingParams | None, Policy | None]]:
    """(name, params, the proposer's policy during it (``POLICY``'s values; None: all off) per system; params
    None: transformers."""
    base = llm.default_params(max_tokens=max_tokens, temperature=0.0)
    plain = next_token_params(base)
    verified = replace(base, decoding="verified")
    out = [("target-next-token", plain, None), ("target-lookup", replace(verified, draft_source="lookup"), None)]
    if llm.proposer is not None:
        policy = tuple(getattr(llm.proposer, k) for k in POLICY)
        out += [("dflash", replace(verified, draft_source="dflash"), None),
                ("dflash-lookup-first", replace(verified, draft_source="lookup_first"), None)]
        if policy != (None,) * len(POLICY):
            out.append(("default", replace(verified, draft_source="lookup_first"), policy))
    return out


def run_chat_bench(cfg: ChatBenchConfig) -> dict:
    """Run every system on every prompt set and batch size, resuming from ``out_dir/bench.json``; returns the
    results (written after every system).

    Raises:
        ValueError: an unknown prompt set; a model without a chat template.
    """
    out = Path(cfg.out_dir)
    options = {"max_num_seqs": max(cfg.batch_sizes), "dtype": cfg.dtype, "max_model_len": cfg.max_model_len,
               "speculative_config": cfg.speculative_config, "tokenizer": cfg.tokenizer,
               "chat_template": cfg.chat_template}
    llm = LLM(cfg.model, **options)
    widths = {w: load_width(w, lambda **o: LLM(cfg.model, **{**options, **o}), cfg.quantize_lm_head)
              for w in parse_widths(cfg.quantization)}
    if not llm.tokenizer.chat_template:
        raise ValueError(f"model '{llm.name}' has no chat template; the chat prompt sets need one")
    previous = json.loads((out / "bench.json").read_text()) if (out / "bench.json").is_file() else {}
    same = previous.get("config") == asdict(cfg)
    results = {"config": asdict(cfg), "runs": previous.get("runs", []) if same else [], "notes": []}
    done = {(r["system"], r["prompt_set"], r["batch_size"]) for r in results["runs"]}
    smol = smollm2.load_smollm2(llm.device) if cfg.smollm2 and smollm2.is_smollm2(llm) and not \
        smollm2.unavailable_reason() else None
    encoded = {name: [llm.tokenizer.encode_chat([{"role": "user", "content": t}])
                      for t in PROMPT_SETS[name]()[: cfg.num_prompts]] for name in cfg.prompt_sets}
    llama = load_llamacpp(cfg, llm, [p for prompts in encoded.values() for p in prompts], results["notes"])
    for name, prompts in encoded.items():
        results["conditions"] = conditions(cfg, llm, [len(p) for p in prompts])  # type: ignore[arg-type]
        for batch_size in cfg.batch_sizes:
            batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
            reference = None
            plan = [(llm, *s) for s in systems(llm, cfg.max_tokens)]
            plan += [(llm, "transformers", None, None)] if smol is not None else []
            plan += [(llm, "llama.cpp", None, None)] if llama is not None else []
            for width, other in widths.items():  # the same engine systems at each other weight width
                plan += [(other, f"{system}@{width}", p, policy) for system, p, policy in systems(other, cfg.max_tokens)
                         if system != "target-lookup"]
            for owner, system, params, policy in plan:
                key = (system, name, batch_size)
                if key in done:
                    if system == "target-next-token":
                        reference = next(r for r in results["runs"] if (r["system"], r["prompt_set"],
                                                                        r["batch_size"]) == key)["outputs"]
                    continue
                results["runs"].append(run_one(owner, smol if system == "transformers" else llama, system, params,
                                               policy, batches, cfg, reference))
                results["runs"][-1].update(prompt_set=name, batch_size=batch_size,
                                           tokens_per_s_rounds=[results["runs"][-1]["tokens_per_s"]])
                if system == "target-next-token":
                    reference = results["runs"][-1]["outputs"]
                write_json(results, out)
            for turn in range(1, cfg.rounds):  # the same systems again, in a rotated order
                for owner, system, params, policy in plan[turn % len(plan):] + plan[: turn % len(plan)]:
                    run = next(r for r in results["runs"] if (r["system"], r["prompt_set"], r["batch_size"]) ==
                               (system, name, batch_size))
                    if len(run["tokens_per_s_rounds"]) > turn:  # resumed
                        continue
                    again = run_one(owner, smol if system == "transformers" else llama, system, params, policy,
                                    batches, cfg, None)
                    add_round(run, again)
                    write_json(results, out)
    if cfg.own_process_memory:
        first = encoded[cfg.prompt_sets[0]][:2]
        results["own_process"] = previous["own_process"] if same and "own_process" in previous else \
            own_process_memory(llm, {"model": cfg.model, **options}, first, cfg.max_tokens, llama is not None)
        write_json(results, out)
    if "pass_cost_ms_by_width" not in previous or not same:
        results["pass_cost_ms_by_width"] = {f"batch {b}": pass_cost_ms(llm.model, (1, 2, 4, 8, 16), repeats=10, batch=b)
                                            for b in (1, 8)}
    else:
        results["pass_cost_ms_by_width"] = previous["pass_cost_ms_by_width"]
    if widths:
        first = PROMPT_SETS[cfg.prompt_sets[0]]()[: cfg.quality_prompts]
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in first]
        plain = systems(llm, cfg.max_tokens)[0][1]  # target-next-token's params: greedy, the target alone
        results["widths"] = {}
        for width, other in widths.items():
            report, warning = width_report(llm, other, width, prompts, plain, lambda m: {
                f"batch {b}": pass_cost_ms(m.model, (1, 2, 4, 8, 16), repeats=10, batch=b, runner=m.engine.runner)
                for b in (1, 8)})
            results["widths"][width] = report
            if warning:
                results["notes"].append(warning)
        if warning := speed_floor(results["runs"], results["widths"]):
            results["notes"].append(warning)
    write_json(results, out)
    return results


def load_llamacpp(cfg: ChatBenchConfig, llm: LLM, prompts: list[list[int]], notes: list[str]):  # noqa: ANN201
    """llama.cpp on ``llm``'s ``.gguf`` file (``celeris.bench.llamacpp.load``) with a context that holds the longest
    prompt and its answer (at most ``llm.context_length``), or None with a line in ``notes`` saying why not
    (``--no-llamacpp``, llama-cpp-python not installed, a checkpoint that is no ``.gguf`` file)."""
    reason = llamacpp.unavailable_reason(llm.gguf_path) if cfg.llamacpp else "llama.cpp left out (--no-llamacpp)"
    if reason:
        notes.append(reason)
        return None
    return llamacpp.load(llm.gguf_path, min(llm.context_length, max(map(len, prompts)) + cfg.max_tokens))


def run_one(llm: LLM, other, system: str, params: SamplingParams | None, policy: Policy | None,  # noqa: ANN001
            batches: list[list[list[int]]], cfg: ChatBenchConfig, reference: list[list[int]] | None) -> dict:
    """One system over every batch: run_system's timings plus drafter passes, acceptance and answer quality.
    ``params`` None: a system outside the engine, ``other`` its model (``transformers``: SmolLM2's (model,
    tokenizer); ``llama.cpp``: a ``llama_cpp.Llama``)."""
    proposer = llm.proposer
    if proposer is not None:
        saved = tuple(getattr(proposer, k) for k in POLICY)
        for k, v in zip(POLICY, policy or (None,) * len(POLICY), strict=True):
            setattr(proposer, k, v)
    calls, before = (proposer.calls if proposer else 0), draft_counts(llm)
    base = llm.default_params()  # the model's penalties, given to the systems outside the engine too
    penalties = {k: getattr(base, k) for k in PENALTIES}

    def decode(batch):
        if system == "llama.cpp":  # the same prompt ids, the engine's end-of-text and end-of-turn ids
            return llamacpp.generate(other, batch, cfg.max_tokens, llm.end_token_ids, penalties)
        if params is None:
            texts = [llm.tokenizer.decode(p, skip_special_tokens=False) for p in batch]
            ids, nfe, ttft = smollm2.generate_hf(*other, texts, cfg.max_tokens, penalties)
            return ids, nfe, [ttft] * len(batch)
        reqs = [llm.engine.add_request(p, llm.fit_max_tokens(params, len(p))) for p in batch]
        while llm.engine.has_unfinished():
            llm.engine.step()
        outs = [llm.to_output("", r) for r in reqs]
        return [o.token_ids for o in outs], [o.nfe for o in outs], [o.ttft_s for o in outs]

    hits: list[int] = []  # the prefix cache's hit tokens when the timed calls start

    def reset() -> None:
        llm.reset_prefix_cache()
        hits.append(llm.engine.stats().prefix_cache_hits)

    try:
        run = run_system(system, decode, batches, cfg.warmup, reset if params is not None else None)
    finally:
        if proposer is not None:
            for k, v in zip(POLICY, saved, strict=True):
                setattr(proposer, k, v)
    after = draft_counts(llm)
    before = before or [(0, 0)] * len(after)
    run["drafter_passes"] = (proposer.calls - calls) if proposer else 0
    # prompt tokens the timed calls took from the prefix cache (blocks the run's own prompts share); None outside
    run["prefix_cache_hit_tokens"] = llm.engine.stats().prefix_cache_hits - hits[0] if hits else None
    run["draft_acceptance"] = [round((a - a0) / (d - d0), 4) if d > d0 else None
                               for (d0, a0), (d, a) in zip(before, after, strict=False)]
    outputs = run["outputs"]
    run["ended_share"] = round(sum(len(o) < cfg.max_tokens for o in outputs) / len(outputs), 4)
    run["repetition_share"] = round(sum(max_repeat_run(o) > 8 for o in outputs) / len(outputs), 4)
    run["distinct_2"] = distinct_2(outputs)
    if reference is not None and system != "transformers":  # transformers' ids are its own tokenizer's
        prompts = [p for b in batches for p in b]
        run["mismatches"] = mismatches(llm, prompts, outputs, reference)
    if system == "llama.cpp":
        run["note"] = llamacpp.NOTE
    return run


def add_round(run: dict, again: dict) -> None:
    """Fold a later round's timing of the same system (``again``) into ``run``: ``tokens_per_s_rounds`` gets its
    tokens/s and ``tokens_per_s`` becomes their median (the other timings stay the first round's); a round whose
    answers differ from the first's is counted in ``unstable_rounds`` (greedy decoding should not differ)."""
    run["tokens_per_s_rounds"].append(again["tokens_per_s"])
    run["tokens_per_s"] = round(statistics.median(run["tokens_per_s_rounds"]), 2)
    run["unstable_rounds"] = run.get("unstable_rounds", 0) + (again["outputs"] != run["outputs"])


def format_chat_table(results: dict) -> str:
    cols = ["system", "prompt_set", "batch_size", "tokens_per_s", "ttft_mean_s", "latency_p50_s", "latency_p95_s",
            "tokens_per_forward", "drafter_passes", "ended_share", "repetition_share", "distinct_2", "peak_rss_mb"]
    rows = [cols] + [[str(r.get(c, "")) for c in cols] + [str(len(r.get("mismatches", [])))]
                     for r in results["runs"]]
    rows[0] = cols + ["mismatches"]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
