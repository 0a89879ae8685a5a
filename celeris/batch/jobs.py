"""Batch jobs: a JSONL file of requests in, one OpenAI Batch output record per request out, crash-safe.

Input, one request per line (blank lines are skipped), in either form:

* the OpenAI Batch format (as vLLM's ``run_batch``)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "...", "max_tokens": 32}}

* a short form; every key besides the id and the prompt goes into the request body as it is
  (``max_new_tokens`` is accepted as a name for ``max_tokens``)::

    {"id": "q1", "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "seed": 1, "steps": 16}
    {"id": "q2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}

Output, one line per request in the OpenAI Batch output format::

    {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id": "...", "body": {...}},
     "error": null}

A request the server refuses (empty prompt, prompt over the context window, bad parameter) keeps
its 4xx ``response``, exactly as the HTTP server would have answered; a line that never became a
request (bad JSON, no id, unknown url) gets ``response: null`` and ``error: {code, message}``. A
line without a usable id is recorded with ``custom_id: null`` and its 1-based ``line`` number.
Records are written in completion order, not input order.

Crash safety (the order of the steps is what makes it safe):

1. Validate before any work: duplicate ids refuse the whole job (``DuplicateIdError``, naming the
   lines), because a resumed job could not tell which of two equal ids is done.
2. Read the existing output. A torn last line (a crash mid-write: no trailing newline, or not
   JSON) is truncated away, so its item counts as not done. Every other record marks its id done.
3. ``retry_failed``: failed records (an ``error``, or a status other than 200) are first removed
   by an atomic rewrite (temp file, fsync, ``os.replace``), so their ids count as not done.
4. Run only the ids not done; each record is appended, flushed and fsynced when its request
   finishes. An item is done only once its record is on disk: one that was running during a
   crash is run again, and no id is ever written twice.

The input is streamed twice (scan, then run) and never held in memory; what is held is one key
per input line (for duplicates) and the set of done keys. A lock file next to the output keeps two
jobs from writing the same output.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
QUEUE_FULL_RETRIES = 50  # a 429 (server at capacity) is waited out, not recorded as a failure
QUEUE_FULL_BACKOFF_S = 0.05
MAX_LISTED_DUPLICATES = 10

Key = str | tuple[str, int]  # custom_id, or ("line", n) for a line without a usable id


class BatchError(Exception):
    """A job that cannot start or go on (bad input file, unreadable output, locked output); exit code 2."""


class DuplicateIdError(BatchError):
    """Some custom_ids appear on more than one line; nothing was run."""


class EngineUnavailableError(BatchError):
    """The engine died mid-job (503); records already written stay, the rest are run on the next start."""


# ---------------------------------------------------------------------------------------------
# Input


@dataclass(slots=True)
class BatchItem:
    """One input line.

    Attributes:
        line_no: 1-based line number in the input file.
        custom_id: the request's id; None when the line has no usable one.
        url: the endpoint ("/v1/completions" or "/v1/chat/completions").
        body: the OpenAI request body.
        error_code / error_message: set when the line cannot become a request.
    """

    line_no: int
    custom_id: str | None
    url: str | None = None
    body: dict[str, Any] | None = None
    error_code: str | None = None
    error_message: str | None = None

    @property
    def key(self) -> Key:
        return self.custom_id if self.custom_id is not None else ("line", self.line_no)

    def to_json(self) -> str:
        return json.dumps({"line": self.line_no, "custom_id": self.custom_id, "url": self.url, "body": self.body})

    @classmethod
    def from_json(cls, text: str) -> BatchItem:
        d = json.loads(text)
        return cls(d["line"], d["custom_id"], d["url"], d["body"])


def _coerce_id(value: Any) -> str | None:
    """A usable id: a non-empty string, or an integer (kept as its decimal string)."""
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def parse_line(text: str, line_no: int) -> BatchItem:
    """Turn one input line (OpenAI Batch format or short form) into a BatchItem; never raises."""

    def bad(code: str, message: str, cid: str | None = None) -> BatchItem:
        return BatchItem(line_no, cid, error_code=code, error_message=f"line {line_no}: {message}")

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return bad("invalid_json", f"not valid JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(obj, dict):
        return bad("invalid_json", f"expected a JSON object, got {type(obj).__name__}")
    if any(k in obj for k in ("url", "body", "method")):  # OpenAI Batch format
        cid = _coerce_id(obj.get("custom_id"))
        if cid is None:
            return bad("missing_custom_id", "'custom_id' must be a non-empty string")
        method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
        if method != "POST":
            return bad("invalid_method", f"'method' must be POST, got {method!r}", cid)
        if url not in ENDPOINTS:
            return bad("invalid_url", f"'url' must be one of {', '.join(ENDPOINTS)}, got {url!r}", cid)
        if not isinstance(body, dict):
            return bad("invalid_body", "'body' must be a JSON object", cid)
        return BatchItem(line_no, cid, url, body)
    # Short form: {"id": ..., "prompt" | "messages": ..., sampling settings...}
    raw_id = obj.pop("id", None)
    if raw_id is None:
        raw_id = obj.pop("custom_id", None)
    cid = _coerce_id(raw_id)
    if cid is None:
        return bad("missing_custom_id", "'id' must be a non-empty string or an integer")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        return bad("invalid_request", "give exactly one of 'prompt' (completion) or 'messages' (chat)", cid)
    if "max_new_tokens" in obj and "max_tokens" not in obj:
        obj["max_tokens"] = obj.pop("max_new_tokens")
    return BatchItem(line_no, cid, ENDPOINTS[0] if has_prompt else ENDPOINTS[1], obj)


def iter_items(path: str | Path) -> Iterator[BatchItem]:
    """Stream the input file's non-blank lines as BatchItems."""
    try:
        handle = open(path, encoding="utf-8", errors="replace")
    except OSError as exc:
        raise BatchError(f"cannot read the input file '{path}': {exc.strerror}") from None
    with handle:
        for line_no, line in enumerate(handle, start=1):
            if line.strip():
                yield parse_line(line, line_no)


def scan_input(path: str | Path) -> set[Key]:
    """All keys of the input; raises DuplicateIdError naming every duplicated id and its lines."""
    first_line: dict[Key, int] = {}
    duplicates: dict[str, list[int]] = {}
    for item in iter_items(path):
        key = item.key
        if key in first_line:
            duplicates.setdefault(str(key), [first_line[key]]).append(item.line_no)
        else:
            first_line[key] = item.line_no
    if duplicates:
        listed = "; ".join(f"'{cid}' on lines {', '.join(map(str, lines))}"
                           for cid, lines in list(duplicates.items())[:MAX_LISTED_DUPLICATES])
        more = f" (and {len(duplicates) - MAX_LISTED_DUPLICATES} more)" if len(duplicates) > MAX_LISTED_DUPLICATES else ""
        raise DuplicateIdError(f"{path}: {len(duplicates)} duplicate id(s), nothing was run: {listed}{more}")
    return set(first_line)


# ---------------------------------------------------------------------------------------------
# Output records


def _record(item: BatchItem, response: dict | None, error: dict | None) -> dict:
    record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item.custom_id, "response": response,
              "error": error}
    if item.custom_id is None:
        record["line"] = item.line_no
    return record


def error_record(item: BatchItem, code: str | None = None, message: str | None = None) -> dict:
    """A record for a request that got no response (the line was malformed, or an internal error)."""
    return _record(item, None, {"code": code or item.error_code, "message": message or item.error_message})


def response_record(item: BatchItem, status_code: int, body: dict) -> dict:
    return _record(item, {"status_code": status_code, "request_id": f"req_{uuid.uuid4().hex}", "body": body}, None)


def record_key(record: dict) -> Key:
    cid = record.get("custom_id")
    return cid if cid is not None else ("line", int(record.get("line", -1)))


def is_success(record: dict) -> bool:
    """A record counts as done-and-good: no ``error`` and an HTTP 200 response."""
    response = record.get("response") or {}
    return record.get("error") is None and response.get("status_code") == 200


@dataclass(slots=True)
class OutputState:
    """What an existing output file already holds: last record per key succeeded or not."""

    status: dict[Key, bool] = field(default_factory=dict)
    num_records: int = 0
    torn_bytes: int = 0  # bytes of a torn last line that were truncated away


def read_output(path: str | Path, repair: bool = True) -> OutputState:
    """Read an output file, truncating a torn last line when ``repair``.

    Raises:
        BatchError: a line other than the last is not a record (the file is not ours, or damaged).
    """
    state = OutputState()
    path = Path(path)
    if not path.exists():
        return state
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
                state.status[record_key(record)] = is_success(record)
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


def rewrite_without(path: str | Path, drop: set[Key]) -> int:
    """Atomically rewrite the output without the records whose key is in ``drop``; returns how many went."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.rewrite.tmp")
    dropped = 0
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for raw in src:
            if raw.strip() and record_key(json.loads(raw)) in drop:
                dropped += 1
                continue
            dst.write(raw)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)
    _fsync_dir(path)
    return dropped


class ResultWriter:
    """Appends records to the output: one ``write`` + flush + fsync per record, so a crash loses at
    most the record being written (a torn line that the next start truncates)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        is_new = not self.path.exists()
        self._fh = open(self.path, "ab")
        if is_new:
            _fsync_dir(self.path)

    def write(self, record: dict) -> None:
        self._fh.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def output_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on ``OUTPUT.lock`` (released by the kernel even on SIGKILL)."""
    lock_path = Path(f"{path}.lock")
    fh = open(lock_path, "w")
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BatchError(f"another batch job is writing '{path}' (it holds {lock_path})") from None
        yield
    finally:
        fh.close()


# ---------------------------------------------------------------------------------------------
# Planning and progress


@dataclass(slots=True)
class JobPlan:
    """What a (re)started job must do.

    Attributes:
        done: keys whose record stays in the output (skipped by this run).
        num_items: input lines (non-blank).
        num_todo: items this run will produce a record for.
        num_retried: failed records removed for ``retry_failed``.
        num_foreign: records in the output whose id is not in the input (kept as they are).
        torn_bytes: bytes of a torn last line truncated away.
    """

    done: set[Key]
    num_items: int
    num_todo: int
    num_retried: int = 0
    num_foreign: int = 0
    torn_bytes: int = 0


def plan_job(input_path: str | Path, output_path: str | Path, retry_failed: bool = False,
             keys: set[Key] | None = None) -> JobPlan:
    """Validate the input, repair the output and decide what to run (steps 1-3 of the module doc).

    ``keys``: the input's keys when ``scan_input`` already ran (callers scan before taking the lock).
    """
    keys = scan_input(input_path) if keys is None else keys
    try:
        state = read_output(output_path, repair=True)
    except OSError as exc:
        raise BatchError(f"cannot read the output file '{output_path}': {exc.strerror}") from None
    known = {k: ok for k, ok in state.status.items() if k in keys}
    failed = {k for k, ok in known.items() if not ok}
    num_retried = 0
    if retry_failed and failed:
        num_retried = rewrite_without(output_path, failed)
        known = {k: ok for k, ok in known.items() if ok}
    done = set(known)
    return JobPlan(done, len(keys), len(keys) - len(done), num_retried, len(state.status) - len(set(state.status) & keys),
                   state.torn_bytes)


def iter_todo(input_path: str | Path, done: set[Key]) -> Iterator[BatchItem]:
    """The input's items not in ``done``, each key once (even if the file changed since the scan)."""
    seen: set[Key] = set()
    for item in iter_items(input_path):
        if item.key not in done and item.key not in seen:
            seen.add(item.key)
            yield item


class Progress:
    """Counts records as they are written and drives a tqdm bar (items/s and ETA)."""

    def __init__(self, total: int, enabled: bool = True, desc: str = "batch") -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="req", desc=desc, disable=not enabled, mininterval=0.5, dynamic_ncols=True)
        self.num_succeeded = 0
        self.num_failed = 0

    def record(self, record: dict) -> None:
        if is_success(record):
            self.num_succeeded += 1
        else:
            self.num_failed += 1
            self.bar.set_postfix(failed=self.num_failed, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def summary(plan: JobPlan, progress: Progress, input_path, output_path, seconds: float) -> dict:
    ran = progress.num_succeeded + progress.num_failed
    return {
        "input": str(input_path), "output": str(output_path), "items": plan.num_items,
        "skipped_done": len(plan.done), "retried": plan.num_retried, "ran": ran,
        "succeeded": progress.num_succeeded, "failed": progress.num_failed,
        "torn_bytes_truncated": plan.torn_bytes, "foreign_records": plan.num_foreign,
        "seconds": round(seconds, 3), "items_per_s": round(ran / seconds, 3) if seconds > 0 else None,
    }


# ---------------------------------------------------------------------------------------------
# Running


async def run_item(serving, item: BatchItem) -> dict:
    """Send one item through ``OpenAIServing.respond`` (the HTTP server's code path); returns its record.

    A 429 (server at capacity) is retried after a short wait; a 503 (engine gone) raises
    EngineUnavailableError so the item stays not done.
    """
    for attempt in range(QUEUE_FULL_RETRIES + 1):
        try:
            status, body = await serving.respond(item.url, item.body)
        except Exception as exc:  # not an APIError: a bug somewhere below; record it and go on
            return error_record(item, "internal_error", f"{type(exc).__name__}: {exc}")
        if status == 429 and attempt < QUEUE_FULL_RETRIES:
            await asyncio.sleep(QUEUE_FULL_BACKOFF_S * min(2**attempt, 20))
            continue
        if status == 503:
            raise EngineUnavailableError(f"the engine is unavailable: {body.get('error', {}).get('message')}")
        return response_record(item, status, body)
    raise AssertionError("unreachable")


async def drive(get_serving: Callable[[], Any], items: Iterator[BatchItem], sink: Callable[[dict], None],
                window: int) -> None:
    """Run ``items`` with at most ``window`` requests in flight, handing each record to ``sink`` as it
    finishes. Lines that never became requests are recorded at once; ``get_serving()`` is first
    called for the first real request (a job of only malformed lines loads no model)."""
    pending: set[asyncio.Task] = set()

    async def harvest(block_until: int) -> None:
        nonlocal pending
        while len(pending) > block_until:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failure = None
            for task in done:
                if task.exception() is not None:
                    failure = failure or task.exception()
                else:
                    sink(task.result())
            if failure is not None:
                raise failure

    try:
        for item in items:
            if item.error_code is not None:
                sink(error_record(item))
                continue
            pending.add(asyncio.create_task(run_item(get_serving(), item)))
            await harvest(window - 1)
        await harvest(0)
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


def run_batch(
    input_path: str | Path,
    output_path: str | Path,
    make_serving: Callable[[], Any],
    *,
    retry_failed: bool = False,
    window: int = 16,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Run (or resume) a batch job locally; returns a summary dict.

    Args:
        make_serving: builds an ``OpenAIServing`` (not started); called only when there is work.
        window: most requests in flight at once (about 2x the engine's ``max_num_seqs`` keeps it full).
        log: where one-line notices go (torn line truncated, failed records removed, ...).
    """
    if window < 1:
        raise BatchError(f"the in-flight window must be >= 1, got {window}")
    start = time.perf_counter()
    keys = scan_input(input_path)  # duplicates refuse the job before anything is created
    with output_lock(output_path):
        plan = plan_job(input_path, output_path, retry_failed, keys)
        report_plan(plan, output_path, log)
        bar = Progress(plan.num_todo, enabled=progress)
        servings: list = []

        def get_serving():
            if not servings:
                servings.append(make_serving())
                servings[0].start()
            return servings[0]

        try:
            with ResultWriter(output_path) as writer:
                def sink(record: dict) -> None:
                    writer.write(record)
                    bar.record(record)

                if plan.num_todo:
                    asyncio.run(drive(get_serving, iter_todo(input_path, plan.done), sink, window))
        finally:
            bar.close()
            for serving in servings:
                serving.stop()
    return summary(plan, bar, input_path, output_path, time.perf_counter() - start)


def report_plan(plan: JobPlan, output_path, log: Callable[[str], None] | None) -> None:
    if log is None:
        return
    if plan.torn_bytes:
        log(f"{output_path}: truncated a torn last line ({plan.torn_bytes} bytes); its item will be run again")
    if plan.num_retried:
        log(f"{output_path}: removed {plan.num_retried} failed record(s); running them again")
    if plan.num_foreign:
        log(f"{output_path}: {plan.num_foreign} record(s) have ids that are not in the input; kept as they are")
    log(f"{plan.num_items} items: {len(plan.done)} already done, {plan.num_todo} to run")
