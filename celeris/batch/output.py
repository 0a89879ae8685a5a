"""The output file of a batch job: records, reading and repairing it, appending to it, locking it.

Every function here treats the output as a *file*, not a path string: the lock is an ``flock`` on
the file itself (so a symlink or a hard link to it is the same job), a rewrite replaces the file a
symlink points to (not the symlink), and a write that fails (full disk, file-size limit, I/O
error) is cut back to the last whole record, so the file never keeps a torn line of ours.

Each record carries ``request_hash``: the SHA-256 of the request it answers (``request_hash`` in
``jobs.py``), so a resumed job can tell a done id whose request was edited since.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Key = str | tuple[str, str | int]
"""An item's identity: its custom_id; ("anon", "HASH:k") for the k-th line without a usable id whose
request hash is HASH; ("line", n) for a record written before request hashes existed, without an id."""

# Failures that the same request can never turn into a success: the line never became a request,
# or the server refused it as written (4xx other than a time-out or a full queue).
RETRYABLE_STATUS = frozenset({408, 429})
RETRYABLE_ERROR_CODES = frozenset({"internal_error"})


class BatchError(Exception):
    """A job that cannot start or go on (bad input file, unwritable output, locked output); exit code 2."""


# ---------------------------------------------------------------------------------------------
# Records


def make_record(custom_id: str | None, line_no: int, request_hash: str, response: dict | None,
                error: dict | None) -> dict:
    """One OpenAI Batch output record, plus ``request_hash`` (and ``line`` when there is no id)."""
    record: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
                              "error": error, "request_hash": request_hash}
    if custom_id is None:
        record["line"] = line_no
    return record


def is_success(record: dict) -> bool:
    """A record counts as done-and-good: no ``error`` and an HTTP 200 response."""
    response = record.get("response") or {}
    return record.get("error") is None and response.get("status_code") == 200


def is_retryable(record: dict) -> bool:
    """A failed record that the same request may turn into a success: an internal error, a 5xx, a
    time-out (408) or a full queue (429). Malformed lines and 4xx refusals (bad parameter, prompt
    over the context window) fail the same way every time."""
    if is_success(record):
        return False
    error = record.get("error")
    if error is not None:
        return (error or {}).get("code") in RETRYABLE_ERROR_CODES
    status = (record.get("response") or {}).get("status_code")
    return not isinstance(status, int) or status >= 500 or status in RETRYABLE_STATUS


@dataclass(slots=True)
class RecordInfo:
    """What a resumed job needs of one record: did it succeed, may a retry help, which request it answers."""

    is_success: bool
    is_retryable: bool
    request_hash: str | None  # None: written before request hashes existed


class RecordKeys:
    """Names records by Key, in file order (the k-th id-less record of one request hash is ``HASH:k``)."""

    def __init__(self) -> None:
        self._anon: Counter[str] = Counter()

    def __call__(self, record: dict) -> Key:
        cid = record.get("custom_id")
        if cid is not None:
            return str(cid)
        digest = record.get("request_hash")
        if isinstance(digest, str):
            k = self._anon[digest]
            self._anon[digest] += 1
            return ("anon", f"{digest}:{k}")
        return ("line", int(record.get("line", -1)))


# ---------------------------------------------------------------------------------------------
# Reading and repairing


@dataclass(slots=True)
class OutputState:
    """What an existing output file already holds: the last record per key."""

    records: dict[Key, RecordInfo] = field(default_factory=dict)
    num_records: int = 0
    torn_bytes: int = 0  # bytes of a torn last line that were truncated away

    @property
    def status(self) -> dict[Key, bool]:
        """Key -> whether its last record succeeded."""
        return {k: info.is_success for k, info in self.records.items()}


def read_output(path: str | Path, repair: bool = True) -> OutputState:
    """Read an output file, truncating a torn last line when ``repair``.

    Raises:
        BatchError: a line other than the last is not a record (the file is not ours, or damaged).
        OSError: the file cannot be read (or, with ``repair``, truncated).
    """
    state = OutputState()
    path = Path(path)
    if not path.exists():
        return state
    keys = RecordKeys()
    offset, cut = 0, None  # cut: (line number, byte offset) of a line that is not a record
    with open(path, "rb") as fh:
        for i, raw in enumerate(fh, start=1):
            if cut is not None:
                raise BatchError(f"{path}: line {cut[0]} is not valid JSON and is not the last line; "
                                 "refusing to append to a damaged output file")
            record = None
            if raw.endswith(b"\n"):
                try:
                    record = json.loads(raw)
                except ValueError:
                    pass
            if record is None:
                if raw.strip():
                    cut = (i, offset)
            elif not isinstance(record, dict) or "custom_id" not in record:
                raise BatchError(f"{path}: line {i} is not a batch output record (no 'custom_id')")
            else:
                digest = record.get("request_hash")
                state.records[keys(record)] = RecordInfo(is_success(record), is_retryable(record),
                                                         digest if isinstance(digest, str) else None)
                state.num_records += 1
            offset += len(raw)
    if cut is not None:  # a torn last line: a crash mid-write
        state.torn_bytes = offset - cut[1]
        if repair:
            with open(path, "r+b") as fh:
                fh.truncate(cut[1])
                fh.flush()
                os.fsync(fh.fileno())
    return state


def _fsync_dir(path: Path) -> None:
    fd = os.open(path.parent if str(path.parent) else ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


# ---------------------------------------------------------------------------------------------
# The lock


class OutputLock:
    """An exclusive ``flock`` on the output file itself, held until ``release`` (the kernel drops it
    even on SIGKILL). Every name of the file (a symlink, a hard link) reaches the same lock."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fds: list[int] = []

    def acquire(self) -> None:
        """Open (creating it if need be) and lock the output.

        Raises:
            BatchError: the output cannot be opened for writing (read-only file or folder, a folder,
                ...) or another job holds the lock.
        """
        existed = self.path.exists()
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o666)
            except OSError as exc:
                raise BatchError(f"cannot write the output file '{self.path}': {_reason(exc)}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise BatchError(f"another batch job is writing '{self.path}' (the same file, maybe under "
                                 "another name: a symlink or a hard link)") from None
            # Between open and flock a --retry-failed rewrite of another job may have put a new file
            # at this name; then the lock taken is on the old one: try again.
            opened = os.fstat(fd)
            try:
                now = os.stat(self.path)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino):
                self._fds.append(fd)
                if not existed:
                    _fsync_dir(Path(os.path.realpath(self.path)))
                return
            os.close(fd)
        raise BatchError(f"the output file '{self.path}' keeps being replaced by another process")

    def adopt(self, fd: int) -> None:
        """Hold the lock of a file that is about to replace the output (already flocked by the caller)."""
        self._fds.append(fd)

    def fileno(self) -> int:
        """The descriptor of the locked output file (the first one)."""
        return self._fds[0]

    def release(self) -> None:
        while self._fds:
            os.close(self._fds.pop())


@contextmanager
def output_lock(path: str | Path) -> Iterator[OutputLock]:
    """Hold ``OutputLock(path)`` for the duration of the block."""
    lock = OutputLock(path)
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()


# ---------------------------------------------------------------------------------------------
# Rewriting and appending


def rewrite_without(path: str | Path, drop: set[Key], lock: OutputLock | None = None,
                    line_keys: dict[int, Key] | None = None) -> int:
    """Atomically rewrite the output without the records whose key is in ``drop``; returns how many went.

    The new file is written next to the file the path resolves to (a symlink keeps pointing at it),
    fsynced, locked (when ``lock`` is given, before it takes the name, so no other job can slip in)
    and renamed over it. ``line_keys`` maps the line numbers of records written before request
    hashes existed to the keys their lines have now.

    Raises:
        BatchError: the file has other hard links (a new file would split them), or the folder is
            not writable, or the disk is full (the output is then left as it was).
    """
    path = Path(path)
    real = Path(os.path.realpath(path))
    links = os.stat(real).st_nlink
    if links > 1:
        raise BatchError(f"'{path}' has {links} hard links: removing records writes a new file, which the other "
                         "names would not see; copy the output to a file of its own and run on that")
    tmp = real.with_name(f".{real.name}.rewrite.tmp")
    keys, dropped = RecordKeys(), 0
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise BatchError(f"cannot rewrite the output file '{path}' (a new file next to it): {_reason(exc)}") from None
    try:
        with open(real, "rb") as src, os.fdopen(os.dup(fd), "wb") as dst:
            for raw in src:
                if raw.strip():
                    key = keys(json.loads(raw))
                    if isinstance(key, tuple) and key[0] == "line" and line_keys:
                        key = line_keys.get(int(key[1]), key)
                    if key in drop:
                        dropped += 1
                        continue
                dst.write(raw)
            dst.flush()
            os.fsync(dst.fileno())
        if lock is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(tmp, real)
    except OSError as exc:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise BatchError(f"cannot rewrite the output file '{path}': {_reason(exc)}; it was left as it was") from None
    if lock is not None:
        lock.adopt(fd)
    else:
        os.close(fd)
    _fsync_dir(real)
    return dropped


class ResultWriter:
    """Appends records to the output: one write + fsync per record, so a crash loses at most the
    record being written (a torn line that the next start truncates). A write that fails (full
    disk, file-size limit) is cut back to the last whole record and raises BatchError."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            raise BatchError(f"cannot write the output file '{self.path}': {_reason(exc)}") from None
        self.num_written = 0

    def write(self, record: dict) -> None:
        """Append one record as one line and fsync it.

        Raises:
            BatchError: the write or the fsync failed; the file is truncated back to its size before
                this record, so the record's item counts as not done and the next start runs it.
        """
        data = memoryview((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        size = os.fstat(self._fd).st_size  # O_APPEND: the record goes here
        try:
            while data:
                data = data[os.write(self._fd, data):]
            os.fsync(self._fd)
        except OSError as exc:
            try:
                os.ftruncate(self._fd, size)  # no torn line: the record is whole or absent
            except OSError:
                pass  # the next start truncates the torn line
            raise BatchError(f"cannot write to '{self.path}': {_reason(exc)}; the {self.num_written} record(s) "
                             "written by this run are kept; make room and rerun the same command to finish") from None
        self.num_written += 1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
