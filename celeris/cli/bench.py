"""`celeris bench`: decoding systems side by side (HumanEval, or the chat prompt sets)."""

from __future__ import annotations

import argparse
from pathlib import Path

from celeris.cli.common import (
    EMBEDDED_AR,
    UsageError,
    _engine_args,
    _max_model_len_arg,
    _threads_arg,
    _tokenizer_args,
    _tokenizer_overrides,
)
from celeris.data import existing


def add_parsers(sub) -> None:  # noqa: ANN001 - argparse's subparsers action
    """`celeris bench`."""
    b = sub.add_parser("bench", help="speed and quality of decoding systems side by side (JSON + PNG)")
    b.add_argument("--model", help="diffusion checkpoint (default: the embedded model)")
    b.add_argument("--ar-model", help=f"autoregressive twin checkpoint, same tokenizer as --model (default for the "
                   f"embedded model: {EMBEDDED_AR}; 'none' leaves the ar-twin system out)")
    b.add_argument("--lengths", default="64,128,256", help="comma-separated output lengths")
    b.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes (prompts decoded together)")
    b.add_argument("--num-prompts", type=int, default=8, help="first N prompts of each set")
    b.add_argument("--prompt-set", help="humaneval (code completions), or comma-separated chat sets through the chat "
                   "template: mt-bench, gsm8k, summarisation (celeris.bench.chat; one --lengths value). Default: "
                   "all three for a model with a drafter (the default model), else humaneval")
    b.add_argument("--warmup", type=int, default=1, help="untimed batches per system and length")
    b.add_argument("--rounds", type=int, default=1, help="chat sets: run every system this many times, the order "
                   "rotated each round, and report the median tokens/s (a drifting machine then favours no system)")
    b.add_argument("--prompts", help="HumanEval JSONL(.gz) file (default: the HumanEval set shipped in celeris/data)")
    b.add_argument("--out", default="bench-results", help="folder for bench.json and tokens_per_s.png")
    b.add_argument("--no-smollm2", action="store_true", help="leave SmolLM2-135M out even when installed")
    b.add_argument("--no-llamacpp", action="store_true", help="chat sets: leave llama.cpp (on the same .gguf file) "
                   "out even when llama-cpp-python is installed")
    b.add_argument("--fast-tokens-per-step", type=int,
                   help="dllm-fast: ceil(length / K) denoising steps instead of the model's steps")
    b.add_argument("--fast-suffix-window", type=int,
                   help="dllm-fast: passes see only W masked columns past the block (default: the model's)")
    _tokenizer_args(b)
    _engine_args(b, "dtype", dtype={"help": "weights of the diffusion model and the twin (default: bfloat16 on "
                                    "CUDA, float32 on CPU)"})
    _max_model_len_arg(b)
    _threads_arg(b)


def bench_ar_model(model: str | None, ar_model: str | None) -> str | None:
    """The autoregressive twin `celeris bench` runs: ``ar_model`` as given ('none': no twin), else the
    embedded twin when ``model`` is the embedded default (a twin must share the model's tokenizer).

    Raises:
        CheckpointError: the chosen folder does not exist.
    """
    from celeris.llm import EMBEDDED, check_model, resolve_model

    path = resolve_model(model).resolve()
    code_model = path.parent == Path(EMBEDDED).resolve() and path.name.startswith("celeris-code-6m")
    if ar_model is None and code_model and path.name != EMBEDDED_AR:  # the embedded code models share one tokenizer
        ar_model = EMBEDDED_AR if resolve_model(EMBEDDED_AR).is_dir() else None  # a name: no machine path
    ar_model = None if ar_model == "none" else ar_model
    if ar_model:
        check_model(ar_model)
    return ar_model


def _chat_bench(args: argparse.Namespace) -> int:
    """``celeris bench --prompt-set mt-bench,gsm8k,summarisation``: the chat systems (``celeris.bench.chat``)."""
    from celeris.bench.chat import ChatBenchConfig, format_chat_table, run_chat_bench

    lengths = args.lengths.split(",")
    if len(lengths) != 1 or not lengths[0].isdigit():
        raise UsageError(f"--prompt-set {args.prompt_set} takes one --lengths value (max tokens), got '{args.lengths}'")
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",")]
    except ValueError:
        raise UsageError(f"--batch-sizes must be comma-separated integers, got '{args.batch_sizes}'") from None
    cfg = ChatBenchConfig(model=args.model, prompt_sets=args.prompt_set.split(","), max_tokens=int(lengths[0]),
                          batch_sizes=sizes, num_prompts=args.num_prompts, warmup=args.warmup, out_dir=args.out,
                          smollm2=not args.no_smollm2, llamacpp=not args.no_llamacpp, dtype=args.dtype,
                          max_model_len=args.max_model_len, rounds=args.rounds,
                          **_tokenizer_overrides(args))
    results = run_chat_bench(cfg)
    print(format_chat_table(results))
    _print_widths(results)
    for note in results["notes"]:
        print(note if note.startswith("warning:") else f"note: {note}")
    return 0


def _print_widths(results: dict) -> None:
    """The bench's weight widths (``--quantization``): quality, pass cost and resident bytes, one line each, then
    the warnings (``celeris.bench.quantized``)."""
    for width, r in results.get("widths", {}).items():
        if "quality" not in r:
            continue
        q = r["quality"]
        print(f"{width}: top-1 agreement {q['top1_agreement']:.4f}, mean KL {q['mean_kl']:.5f} nats over "
              f"{q['tokens']} tokens, first divergence {q['first_divergence']}, weights "
              f"{r['resident_weight_bytes'] / 2**20:.1f} MiB "
              f"(unquantized {r['reference_resident_weight_bytes'] / 2**20:.1f}), "
              f"pass cost ms by width {r['pass_cost_ms_by_width']}")


def cmd_bench(args: argparse.Namespace) -> int:
    from celeris.bench.run import BenchConfig, format_table, run_bench

    if args.prompts is not None:
        existing(args.prompts, "a HumanEval JSONL(.gz) file", "--prompts")
    if args.prompt_set is None:
        from celeris.llm import resolve_model
        from celeris.models.catalog import read_pairing

        drafter = args.speculative_config or args.speculative_model or read_pairing(resolve_model(args.model))
        args.prompt_set = "mt-bench,gsm8k,summarisation" if drafter else "humaneval"
    if args.prompt_set != "humaneval":
        return _chat_bench(args)
    if args.rounds != 1:
        raise UsageError("--rounds applies to the chat prompt sets (--prompt-set mt-bench,gsm8k,summarisation)")
    ar_model = bench_ar_model(args.model, args.ar_model)
    overrides = _tokenizer_overrides(args)

    def integers(flag: str, text: str) -> list[int]:
        try:
            return [int(x) for x in text.split(",")]
        except ValueError:
            raise UsageError(f"--{flag} must be comma-separated integers, got '{text}'") from None

    try:
        cfg = BenchConfig(model=args.model, ar_model=ar_model, lengths=integers("lengths", args.lengths),
                          batch_sizes=integers("batch-sizes", args.batch_sizes), num_prompts=args.num_prompts,
                          warmup=args.warmup, prompts=args.prompts, out_dir=args.out, smollm2=not args.no_smollm2,
                          fast_tokens_per_step=args.fast_tokens_per_step, fast_suffix_window=args.fast_suffix_window,
                          dtype=args.dtype, max_model_len=args.max_model_len, **overrides)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        results = run_bench(cfg)
    except ValueError as exc:  # e.g. a twin with another tokenizer
        raise UsageError(str(exc)) from None
    print(format_table(results))
    _print_widths(results)
    for note in results["notes"]:
        print(note if note.startswith("warning:") else f"note: {note}")
    print(f"results: {Path(args.out) / 'bench.json'}")
    return 0
