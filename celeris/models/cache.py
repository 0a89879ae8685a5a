"""The conversion cache: checkpoints converted once from another format, kept as ordinary Hugging Face folders.

Layout (one scheme for the engine and the bench)::

    $CELERIS_CACHE (default ~/.cache/celeris)/
      <kind>/<stem>-<key>/           a finished entry: config.json, model.safetensors, tokenizer files, source.json
      <kind>/<stem>-<key>-<variant>/ another form of the same source beside it (``gguf-q``: the weights quantized)
      <kind>/.<stem>-<key>[-<variant>].tmp-<pid>-<random>/   an entry being written by process <pid>

``kind`` names the converter (``gguf``: Celeris's own GGUF conversion, ``celeris.models.gguf``;
``transformers``: the bench's SmolLM2 copy made by transformers' GGUF loader, ``celeris.bench.smollm2``).
``key`` is ``source_key`` of the source file: its size, modification time and a SHA-256 of its first bytes
(the header: metadata and tensor table), so a changed file gets a new entry and an old entry is never read for
it. An entry is written under a temporary name and renamed into place (``os.rename`` of a folder is atomic on
POSIX), so a process killed while converting leaves only a temporary folder, which the next load removes once
the process that wrote it is gone. An entry written with ``checksums`` records the size and SHA-256 of each of
its files in ``source.json``; reading it checks them, and an entry whose record or files disagree (truncated,
overwritten, a torn copy) is removed, not trusted, so the caller converts again.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SOURCE_FILE = "source.json"  # inside every entry: what it was converted from (the key) and when
HEADER_BYTES = 4 << 20  # bytes of the source hashed into the key (a GGUF header: metadata, tokenizer, tensor table)
KINDS = ("gguf", "transformers")


class CacheUnavailableError(OSError):
    """The cache folder cannot be written (read-only, full, not a folder): the caller loads without it."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno N]"
        return str(self.strerror)


def cache_root() -> Path:
    """``$CELERIS_CACHE``, else ``~/.cache/celeris``."""
    return Path(os.environ.get("CELERIS_CACHE") or Path.home() / ".cache" / "celeris")


@dataclass(frozen=True)
class SourceKey:
    """What identifies a source file's content: size in bytes, modification time in ns, SHA-256 of its header."""

    size: int
    mtime_ns: int
    header_sha256: str

    @property
    def short(self) -> str:
        """16 hex digits of a hash over all three fields (the entry folder's suffix)."""
        text = f"{self.size}:{self.mtime_ns}:{self.header_sha256}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def source_key(path: Path) -> SourceKey:
    """The key of ``path`` (reads its first ``HEADER_BYTES`` bytes only)."""
    stat = path.stat()
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(HEADER_BYTES))
    return SourceKey(stat.st_size, stat.st_mtime_ns, digest.hexdigest())


def entry_path(kind: str, source: Path, key: SourceKey, variant: str | None = None) -> Path:
    """The finished entry folder for ``source`` (which may not exist yet); ``variant`` names another form of the
    same source (``gguf-q``), kept beside the plain entry."""
    return cache_root() / kind / (f"{source.stem}-{key.short}" + (f"-{variant}" if variant else ""))


def file_sha256(path: Path) -> str:
    """SHA-256 of a whole file, hex (read in chunks; about 1 GB/s)."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files_agree(folder: Path, files: dict) -> bool:
    """Whether every file ``files`` records (name -> ``{"bytes", "sha256"}``) has that size and hash."""
    try:
        return all((folder / name).stat().st_size == want.get("bytes") and file_sha256(folder / name) == want.get("sha256")
                   for name, want in files.items())
    except (OSError, AttributeError):
        return False


def discard(folder: Path) -> None:
    """Remove a finished entry that must not be read: renamed to a temporary name of this process first, so no
    other process finds it half removed (errors ignored: another process may be removing it too)."""
    doomed = folder.with_name(f".{folder.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.rename(folder, doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def read_entry(kind: str, source: Path, variant: str | None = None) -> Path | None:
    """The finished entry of ``source`` (``variant``: that form of it) whose ``source.json`` matches its current
    key and whose recorded files (``checksums``) are whole, else None. An entry folder that exists but disagrees
    is removed (``discard``), so it is rebuilt; stale temporary folders of ``kind`` left by dead processes are
    removed on the way (errors ignored)."""
    remove_stale(cache_root() / kind)
    key = source_key(source)
    folder = entry_path(kind, source, key, variant)
    if not folder.is_dir():
        return None
    try:
        recorded = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        recorded = {}
    ok = isinstance(recorded, dict) and recorded.get("size") == key.size and recorded.get("mtime_ns") == key.mtime_ns \
        and recorded.get("header_sha256") == key.header_sha256 and recorded.get("variant") == variant \
        and _files_agree(folder, recorded.get("files") or {})
    if not ok:
        discard(folder)
    return folder if ok else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_stale(folder: Path) -> list[Path]:
    """Remove the temporary entries under ``folder`` whose writing process no longer runs; the removed paths."""
    removed = []
    try:
        items = list(folder.iterdir())
    except OSError:
        return removed
    for item in items:
        name = item.name
        if not (name.startswith(".") and ".tmp-" in name):
            continue
        pid_text = name.rsplit(".tmp-", 1)[1].split("-", 1)[0]
        if pid_text.isdigit() and _pid_alive(int(pid_text)):  # still writing (this process included)
            continue
        shutil.rmtree(item, ignore_errors=True)
        removed.append(item)
    return removed


@contextmanager
def writing_entry(kind: str, source: Path, key: SourceKey, info: dict | None = None, variant: str | None = None,
                  checksums: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder to write the entry of ``source`` (``variant``: that form of it) into; on a
    clean exit it gets ``source.json`` (the key, the source's name, the variant, with ``checksums`` the size and
    SHA-256 of every file written, and ``info``) and is renamed to ``entry_path``. On an error the temporary
    folder is removed.

    Raises:
        CacheUnavailableError: the cache cannot be written (read-only, no space, not a folder); nothing is left.
    """
    final = entry_path(kind, source, key, variant)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.mkdir(parents=True)
    except OSError as exc:
        raise CacheUnavailableError(exc.errno, f"cannot write the cache folder {final.parent}: "
                                    f"{exc.strerror or exc}") from exc
    try:
        yield tmp
        record = {"source": source.name, "size": key.size, "mtime_ns": key.mtime_ns,
                  "header_sha256": key.header_sha256, "kind": kind, **(info or {})}
        if variant:
            record["variant"] = variant
        if checksums:
            record["files"] = {f.name: {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
                               for f in sorted(tmp.iterdir()) if f.is_file()}
        (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=1) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / SOURCE_FILE).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same entry first: keep it
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CacheUnavailableError(exc.errno, f"cannot write the cache folder {final.parent}: "
                                    f"{exc.strerror or exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def cached_or_convert(kind: str, source: Path, write: Callable[[Path], dict | None]) -> Path:
    """The finished entry of ``source``, written first by ``write(folder)`` (which returns extra ``source.json``
    fields) when there is none.

    Raises:
        CacheUnavailableError: there is no entry and the cache cannot be written.
    """
    folder = read_entry(kind, source)
    if folder is not None:
        return folder
    key = source_key(source)
    info: dict = {}
    with writing_entry(kind, source, key, info) as tmp:
        info.update(write(tmp) or {})
    return entry_path(kind, source, key)


def list_entries() -> list[dict]:
    """Every finished entry: ``{"kind", "path", "source", "bytes"}`` (and the rest of its ``source.json``)."""
    entries = []
    for kind in KINDS:
        try:
            folders = sorted(p for p in (cache_root() / kind).iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            continue
        for folder in folders:
            try:
                record = json.loads((folder / SOURCE_FILE).read_text())
            except (OSError, ValueError):
                record = {}
            size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
            entries.append({**record, "kind": kind, "path": str(folder), "bytes": size})
    return entries


def clear() -> int:
    """Remove every entry and temporary folder of the known kinds; the number of folders removed.

    Raises:
        OSError: a folder could not be removed (e.g. a read-only cache).
    """
    count = 0
    for kind in KINDS:
        folder = cache_root() / kind
        if not folder.is_dir():
            continue
        for item in list(folder.iterdir()):
            if item.is_dir():
                shutil.rmtree(item)
                count += 1
    return count
