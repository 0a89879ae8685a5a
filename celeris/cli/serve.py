"""`celeris serve`: the OpenAI-compatible server, on this process or on Ray Serve."""

from __future__ import annotations

import argparse
import math
import os
import sys

from celeris.cli.common import (
    UsageError,
    _engine_args,
    _engine_kwargs,
    _model_args,
)


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
