"""Load test of the OpenAI-compatible server: output tokens/s, p50/p95 latency and TTFT per concurrency.

    python -m celeris.bench.loadtest --model celeris/checkpoints/celeris-code-6m
    python -m celeris.bench.loadtest --url http://127.0.0.1:8000 --concurrency 1,8,16,32 --json out.json

Without ``--url`` it starts ``celeris serve`` as a separate process on a free loopback port (as in
deployment, the clients never share the server's process or interpreter lock) and stops it at the end. Every level runs
``concurrency`` closed-loop clients, each sending ``--requests-per-client`` streamed completions
(``stream_options.include_usage``) of fixed prompts (by default the first HumanEval prompts, from the set shipped
in ``celeris/data``; or short built-in code prompts), greedy, so runs are comparable. What is timed:
submit to ``[DONE]`` (latency) and to the first streamed answer text (TTFT), client side; tokens/s
counts output tokens only (``usage.completion_tokens``) over the level's wall time. 429s and other
failures are counted, never hidden.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from celeris.data import HUMANEVAL, existing, read_jsonl

CODE_PROMPTS = [
    "def fibonacci(n):\n",
    "def is_prime(n: int) -> bool:\n",
    "class Stack:\n    def __init__(self):\n",
    "def reverse_words(sentence: str) -> str:\n",
    "import os\n\n\ndef list_python_files(root):\n",
    "def binary_search(items, target):\n",
    "def read_lines(path):\n    with open(path) as handle:\n",
    "def flatten(nested):\n",
]


@dataclass(slots=True)
class Sample:
    status: int
    latency_s: float
    ttft_s: float | None
    completion_tokens: int
    error: str | None = None


@dataclass(slots=True)
class LevelResult:
    concurrency: int
    requests: int
    ok: int
    rejected_429: int
    failed: int
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    latency_p50_s: float | None
    latency_p95_s: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    mean_output_tokens: float | None
    stdev_output_tokens: float | None
    first_error: str | None


def load_prompts(source: str, count: int) -> list[str]:
    """The first ``count`` prompts of ``source``: ``auto`` or ``humaneval`` (the HumanEval set shipped in
    ``celeris/data``), ``code`` (built-in) or a .jsonl[.gz] file with "prompt".

    Raises:
        celeris.data.MissingDataError: the file does not exist. ValueError: it holds no prompt.
    """
    if source == "code":
        return [CODE_PROMPTS[i % len(CODE_PROMPTS)] for i in range(count)]
    path = HUMANEVAL if source in ("auto", "humaneval") else existing(source, "a .jsonl[.gz] file", "--prompts")
    prompts = [r["prompt"] for r in read_jsonl(path)][:count]
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


async def one_request(client, url: str, body: dict, headers: dict) -> Sample:
    start = time.perf_counter()
    ttft, tokens = None, 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return Sample(resp.status_code, time.perf_counter() - start, None, 0, text[:300])
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Sample(500, time.perf_counter() - start, ttft, tokens, json.dumps(chunk["error"])[:300])
                if ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except Exception as exc:  # network failures count as failures, the run goes on
        return Sample(0, time.perf_counter() - start, None, 0, f"{type(exc).__name__}: {exc}")
    return Sample(200, time.perf_counter() - start, ttft, tokens)


async def run_level(url: str, concurrency: int, per_client: int, prompts: list[str], settings: dict,
                    headers: dict, timeout: float, stagger_s: float = 0.0) -> LevelResult:
    """``concurrency`` closed-loop clients, ``per_client`` requests each; client w starts ``w * stagger_s``
    seconds late (so requests run out of phase), and the wall time counts from the first client's start."""
    import httpx

    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def worker(w: int) -> None:
            await asyncio.sleep(w * stagger_s)
            for r in range(per_client):
                prompt = prompts[(w * per_client + r) % len(prompts)]
                body = {"prompt": prompt, "stream": True, "stream_options": {"include_usage": True}, **settings}
                samples.append(await one_request(client, url, body, headers))

        start = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - start
    ok = [s for s in samples if s.status == 200]
    latencies = [s.latency_s for s in ok]
    ttfts = [s.ttft_s for s in ok if s.ttft_s is not None]
    lengths = [s.completion_tokens for s in ok]
    out_tokens = sum(lengths)
    errors = [s.error for s in samples if s.status not in (200, 429)]
    return LevelResult(
        concurrency=concurrency, requests=len(samples), ok=len(ok),
        rejected_429=sum(s.status == 429 for s in samples), failed=len(errors), wall_s=round(wall, 4),
        output_tokens=out_tokens, output_tokens_per_s=round(out_tokens / wall, 2) if wall > 0 else 0.0,
        requests_per_s=round(len(ok) / wall, 3) if wall > 0 else 0.0,
        latency_p50_s=_round(percentile(latencies, 50)), latency_p95_s=_round(percentile(latencies, 95)),
        ttft_p50_s=_round(percentile(ttfts, 50)), ttft_p95_s=_round(percentile(ttfts, 95)),
        mean_output_tokens=_round(statistics.fmean(lengths)) if lengths else None,
        stdev_output_tokens=_round(statistics.pstdev(lengths)) if lengths else None,
        first_error=errors[0] if errors else None,
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def format_table(results: list[LevelResult]) -> str:
    head = ("conc", "reqs", "ok", "429", "fail", "tok/s", "lat p50", "lat p95", "ttft p50", "ttft p95", "tok/ans")
    rows = [head]
    for r in results:
        def ms(v):
            return "-" if v is None else f"{v * 1000:.0f} ms"

        rows.append((str(r.concurrency), str(r.requests), str(r.ok), str(r.rejected_429), str(r.failed),
                     f"{r.output_tokens_per_s:.1f}", ms(r.latency_p50_s), ms(r.latency_p95_s), ms(r.ttft_p50_s),
                     ms(r.ttft_p95_s), "-" if r.mean_output_tokens is None else f"{r.mean_output_tokens:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


LOAD_SETTINGS = ("steps", "block_length", "decoding", "cache")  # sampling settings a load test may set


def build_parser() -> argparse.ArgumentParser:
    from celeris.sampling.params import add_setting_flags  # the server's declaration of these settings

    p = argparse.ArgumentParser(prog="python -m celeris.bench.loadtest", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="target server base URL (default: start `celeris serve` in a separate process)")
    p.add_argument("--model", help="checkpoint folder for the started server (default: the embedded model)")
    p.add_argument("--device", help="device of the started server")
    p.add_argument("--max-num-seqs", type=int, default=8, help="started server: running requests")
    p.add_argument("--max-waiting", type=int, default=64, help="started server: queued requests")
    p.add_argument("--api-key", help="Bearer key for --url")
    p.add_argument("--concurrency", default="1,8,16,32", help="comma-separated client counts")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--prompts", default="auto", help="auto, humaneval, code, or a .jsonl[.gz] with 'prompt'")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    add_setting_flags(p, LOAD_SETTINGS)  # default: the model's
    p.add_argument("--stagger-s", type=float, default=0.0,
                   help="client w starts w * this many seconds late, so requests run out of phase (default 0)")
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and not counted) before measuring")
    p.add_argument("--timeout", type=float, default=300.0, help="client time-out per request, seconds")
    p.add_argument("--json", help="also write the results here")
    return p


def concurrency_levels(args: argparse.Namespace) -> list[int]:
    """The client counts to run; raises ValueError on a bad --concurrency or --stagger-s (before any server starts)."""
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency must list positive integers, got '{args.concurrency}'")
    if not 0 <= args.stagger_s < math.inf:
        raise ValueError(f"--stagger-s must be a finite number >= 0, got {args.stagger_s}")
    return levels


async def run(args: argparse.Namespace, url: str, levels: list[int], prompts: list[str]) -> dict:
    settings = {"max_tokens": args.max_tokens, "temperature": 0.0, "seed": 0}
    for name in LOAD_SETTINGS:
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.warmup:
        await run_level(url, 1, args.warmup, prompts, settings, headers, args.timeout)
    results = []
    for c in levels:
        results.append(await run_level(url, c, args.requests_per_client, prompts, settings, headers, args.timeout,
                                       args.stagger_s))
        print(f"concurrency {c}: {results[-1].output_tokens_per_s:.1f} output tokens/s", file=sys.stderr, flush=True)
    return {"url": url, "prompts": args.prompts, "num_prompts": len(prompts), "settings": settings,
            "requests_per_client": args.requests_per_client, "warmup_requests": args.warmup, "stagger_s": args.stagger_s,
            "levels": [asdict(r) for r in results]}


def start_server(args: argparse.Namespace, start_timeout: float = 180.0) -> tuple[subprocess.Popen, str]:
    """``celeris serve`` in its own process on a free loopback port; returns (process, base URL) once
    ``/health`` answers. Raises RuntimeError (with the server's last output) if it exits or times out."""
    import httpx

    with socket.socket() as probe:  # a free port; the server binds it a moment later
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, "-c", "from celeris.cli import main; raise SystemExit(main())", "serve",
           "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
           "--max-waiting", str(args.max_waiting), "--request-timeout", str(args.timeout), "--log-level", "warning"]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--device", args.device] if args.device else []
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    log.seek(0)
    tail = log.read().decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
    raise RuntimeError(f"the server did not start (exit code {proc.returncode}): {tail[0]}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    server = None
    url = args.url
    try:
        levels = concurrency_levels(args)
        prompts = load_prompts(args.prompts, args.num_prompts)  # before any server starts
        if url is None:
            server, url = start_server(args)
        report = asyncio.run(run(args, url.rstrip("/"), levels, prompts))
    except (RuntimeError, ValueError, FileNotFoundError) as exc:  # a one-line message, no traceback
        print(f"loadtest: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    print(format_table([LevelResult(**lv) for lv in report["levels"]]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
