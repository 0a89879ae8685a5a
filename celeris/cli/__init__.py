"""`celeris generate | chat | serve | batch | eval | bench | train | data | models | cache`: the command line.

The sampling flags of `generate`, `chat` and `eval` are derived from ``SamplingParams``' declaration
(``celeris.sampling.params``) when the parser is built, with the choices the rule and cache registries hold then.

Every user mistake ends with one line on stderr naming the problem and exit
code 2, never a traceback (batch jobs: 0 all lines succeeded, 3 some failed,
1 the engine could not run, 2 a usage error).
"""

from __future__ import annotations

import argparse
import os
import sys

from celeris.cli import batch, bench, generate, models, serve, train
from celeris.cli.bench import bench_ar_model
from celeris.cli.common import EMBEDDED_AR, UsageError, _apply_threads, _load, _Parser
from celeris.models.checkpoint import CheckpointError

__all__ = ["COMMANDS", "EMBEDDED_AR", "UsageError", "bench_ar_model", "build_parser", "main", "_load"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command, each command's flags declared in its own module (``add_parsers``)."""
    parser = _Parser(prog="celeris", description="Celeris: a diffusion language model engine.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    generate.add_parsers(sub)
    train.add_parsers(sub)
    bench.add_parsers(sub)
    models.add_parsers(sub)
    batch._batch_parser(sub)
    serve._serve_parser(sub)
    return parser


COMMANDS = {"generate": generate.cmd_generate, "chat": generate.cmd_chat, "train": train.cmd_train,
            "data": train.cmd_data, "eval": generate.cmd_eval, "bench": bench.cmd_bench, "batch": batch.cmd_batch,
            "serve": serve.cmd_serve, "models": models.cmd_models, "cache": models.cmd_cache}


def main(argv: list[str] | None = None) -> int:
    """Run one command (``argv``: the arguments after ``celeris``; None: ``sys.argv``); returns the exit code: 0,
    2 for a usage error (one ``celeris: error:`` line on stderr), 130 on Ctrl-C, 141 on a closed pipe, or the
    command's own (``celeris batch``: ``BATCH_*``)."""
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # the command as typed (what a record names)
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

