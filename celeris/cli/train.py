"""`celeris train` (masked diffusion, ar, hybrid, dflash) and `celeris data stdlib` (its corpus)."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from celeris.cli.common import (
    UsageError,
)


def add_parsers(sub) -> None:  # noqa: ANN001 - argparse's subparsers action
    """`celeris train` and `celeris data`."""
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
    t.add_argument("--init", help="hybrid: causal checkpoint to start from (name or folder), e.g. celeris-code-6m-ar; "
                   "dflash: a trained drafter (folder or a run's last.pt) to start from")
    t.add_argument("--time-budget", help="dflash: stop after this much wall-clock time (90s, 30m, 2h) or at "
                   "--max-steps, whichever comes first (a session-sized step)")
    t.add_argument("--ship", help="dflash: at the end, replace the drafter in this folder by the trained one only if "
                   "it accepts more on the held-out rows; the step is added to the folder's training-steps.jsonl "
                   "and card either way (celeris.train.ship)")
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
    d = sub.add_parser("data", help="build a training corpus")
    d.add_argument("corpus", choices=["stdlib"], help="stdlib: this Python's standard library")
    d.add_argument("--out", default="data/stdlib")
    d.add_argument("--vocab-size", type=int, default=4096)


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
    if args.init:
        if not Path(args.init).exists():
            raise UsageError(f"--init {args.init}: no drafter folder or last.pt there")
        argv += ["--init", args.init]
    from celeris.train.ship import check_drafter_folder, parse_duration

    try:  # before the run: a usage error, not one at its end
        if args.time_budget:
            parse_duration(args.time_budget)
            argv += ["--time-budget", args.time_budget]
        if args.ship:
            check_drafter_folder(Path(args.ship))
            argv += ["--ship", args.ship]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    typed = getattr(args, "argv", None)
    if typed:  # the step's record names the command as typed, not the cache folder --target resolved to
        argv += ["--record-command", "celeris " + shlex.join(typed)]
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




def cmd_data(args: argparse.Namespace) -> int:
    from celeris.train.data import build_stdlib_corpus

    print(json.dumps(build_stdlib_corpus(args.out, args.vocab_size), indent=2))
    return 0
