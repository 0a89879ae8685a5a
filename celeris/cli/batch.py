"""`celeris batch run | report`: JSONL jobs on the local engine or on Ray (exit codes ``BATCH_*``)."""

from __future__ import annotations

import argparse
import json
import sys

from celeris.cli.common import (
    UsageError,
    _engine_args,
    _engine_kwargs,
    _max_model_len_arg,
    _Parser,
    _threads_arg,
    _tokenizer_args,
)


def _batch_parser(sub) -> None:
    b = sub.add_parser("batch", help="batch jobs: JSONL requests in, OpenAI Batch JSONL out (resumable)")
    bsub = b.add_subparsers(dest="batch_command", required=True, parser_class=_Parser)
    r = bsub.add_parser("run", help="run or resume a job: skips ids already in OUTPUT, runs the rest")
    r.add_argument("input", help="requests, one per line: OpenAI Batch format or {id, prompt|messages, ...}")
    r.add_argument("output", help="results, one OpenAI Batch output record per request (appended as they finish)")
    r.add_argument("--model", help="checkpoint folder or name (default: smollm2-135m-instruct-dflash)")
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
