"""`celeris models` (the names --model accepts) and `celeris cache list | clear` (the conversion cache)."""

from __future__ import annotations

import argparse
import json

from celeris.cli.common import (
    UsageError,
)


def add_parsers(sub) -> None:  # noqa: ANN001 - argparse's subparsers action
    """`celeris models` and `celeris cache`."""
    m = sub.add_parser("models", help="the model names --model accepts besides a path, and whether each is installed")
    m.add_argument("--json", action="store_true", help="print one JSON object")
    ca = sub.add_parser("cache", help="the conversion cache ($CELERIS_CACHE, default ~/.cache/celeris): GGUF "
                        "files converted once, the bench's SmolLM2 copy")
    ca.add_argument("cache_command", choices=["list", "clear"])
    ca.add_argument("--json", action="store_true", help="list: print one JSON object")


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
        kind = e["kind"] + (f" ({e['variant']})" if e.get("variant") else "")  # gguf (gguf-q): kept quantized
        print(f"{kind:<14}  {e['bytes'] / 2**20:9.1f} MiB  {e.get('source', '?')}  {e['path']}")
    return 0
