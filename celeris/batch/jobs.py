"""Batch jobs: a JSONL file of requests in, one OpenAI Batch output record per request out, crash-safe.

Input, one request per line (blank lines are counted, not run), in either form:

* the OpenAI Batch format (as vLLM's ``run_batch``)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "...", "max_tokens": 32}}

* a short form; every key besides the id and the prompt goes into the request body as it is
  (``max_new_tokens`` is accepted as a name for ``max_tokens``)::

    {"id": "q1", "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "seed": 1, "steps": 16}
    {"id": "q2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}

Output, one line per request in the OpenAI Batch output format, plus ``request_hash``::

    {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id": "...", "body": {...}},
     "error": null, "request_hash": "9f86d0..."}

``request_hash`` is the SHA-256 (hex) of the request as run: ``{"url": ..., "body": ...}`` as
canonical JSON (sorted keys), so the two input forms of one request hash alike; for a line that never
became a request, of the line's text. A request the server refuses (empty prompt, prompt over the
context window, bad parameter) keeps its 4xx ``response``, exactly as the HTTP server would have
answered; a line that never became a request (bad JSON, no id, unknown url) gets ``response: null``
and ``error: {code, message}``. A line without a usable id is recorded with ``custom_id: null`` and its
1-based ``line`` number, and is known by its request hash (so deleting another line does not re-key
it). Records are written in completion order, not input order.

Crash safety (the order of the steps is what makes it safe):

1. Validate before any work: an output that is the input file (by any name) is refused; duplicate
   ids refuse the whole job (``DuplicateIdError``, naming the lines), because a resumed job could not
   tell which of two equal ids is done. Only the input's bytes present at this point are read, then
   and later.
2. Lock the output file itself (``flock``: every name of it, symlink or hard link, meets the lock).
3. Read the existing output. A torn last line (a crash mid-write: no trailing newline, or not JSON)
   is truncated away, so its item counts as not done. Every other record marks its id done. A done
   id whose ``request_hash`` differs from its input line's refuses the job (``ChangedInputError``)
   unless ``rerun_changed``; records without a hash (older files) are read as matching.
4. ``retry_failed`` / ``rerun_changed``: those records are first removed by an atomic rewrite (temp
   file, fsync, ``os.replace``), so their ids count as not done.
5. Run only the ids not done; each record is appended and fsynced when its request finishes. An item
   is done only once its record is on disk: one that was running during a crash is run again, and no
   id is ever written twice. A write that fails (full disk) is cut back to the last whole record.

The input is streamed twice (scan, then run) and never held in memory; what is held is one key and
one request hash per input line and the state of every done key.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celeris.batch.inputs import (
    ENDPOINTS,
    MAX_LISTED_DUPLICATES,
    BatchItem,
    DuplicateIdError,
    InputScan,
    check_not_same_file,
    iter_items,
    parse_line,
    request_hash,
    scan_input,
)
from celeris.batch.output import (
    BatchError,
    Key,
    OutputLock,
    RecordInfo,
    ResultWriter,
    is_retryable,
    is_success,
    make_record,
    output_lock,
    read_output,
    rewrite_without,
)

__all__ = ["ENDPOINTS", "BatchError", "BatchItem", "ChangedInputError", "DuplicateIdError", "EngineUnavailableError",
           "InputScan", "Key", "OutputLock", "ResultWriter", "check_not_same_file", "iter_items", "parse_line",
           "is_retryable", "is_success", "output_lock", "read_output", "request_hash", "rewrite_without", "run_batch",
           "scan_input"]

QUEUE_FULL_RETRIES = 50  # a 429 (server at capacity) is waited out, not recorded as a failure
QUEUE_FULL_BACKOFF_S = 0.05


class ChangedInputError(BatchError):
    """Some done ids' requests were edited since their records were written; nothing was run."""


class EngineUnavailableError(BatchError):
    """The engine died mid-job (503); records already written stay, the rest are run on the next start."""


# ---------------------------------------------------------------------------------------------
# Records


def error_record(item: BatchItem, code: str | None = None, message: str | None = None) -> dict:
    """A record for a request that got no response (the line was malformed, or an internal error)."""
    return make_record(item.custom_id, item.line_no, item.request_hash, None,
                       {"code": code or item.error_code, "message": message or item.error_message})


def response_record(item: BatchItem, status_code: int, body: dict) -> dict:
    response = {"status_code": status_code, "request_id": f"req_{uuid.uuid4().hex}", "body": body}
    return make_record(item.custom_id, item.line_no, item.request_hash, response, None)


# ---------------------------------------------------------------------------------------------
# Planning and progress


@dataclass(slots=True)
class JobPlan:
    """What a (re)started job must do.

    Attributes:
        done: keys whose record stays in the output (skipped by this run).
        num_items: input lines (non-blank).
        num_todo: items this run will produce a record for.
        num_lines / num_blank: every input line / the blank ones among them.
        num_retried: failed records removed for ``retry_failed``.
        changed: done keys whose request changed, removed for ``rerun_changed`` (up to 10 listed).
        num_changed: how many those were.
        num_done_failed / num_done_retryable: kept failed records / those a retry may fix.
        num_legacy: kept records written before request hashes existed (read as matching).
        num_foreign: records in the output whose id is not in the input (kept as they are).
        torn_bytes: bytes of a torn last line truncated away.
    """

    done: set[Key]
    num_items: int
    num_todo: int
    num_lines: int = 0
    num_blank: int = 0
    num_retried: int = 0
    changed: list[str] = field(default_factory=list)
    num_changed: int = 0
    num_done_failed: int = 0
    num_done_retryable: int = 0
    num_legacy: int = 0
    num_foreign: int = 0
    torn_bytes: int = 0


def _name(key: Key) -> str:
    return key if isinstance(key, str) else f"<no id: {key[1]}>"


def plan_job(input_path: str | Path, output_path: str | Path, retry_failed: bool = False,
             scan: InputScan | None = None, rerun_changed: bool = False, lock: OutputLock | None = None) -> JobPlan:
    """Validate the input, repair the output and decide what to run (steps 3-4 of the module doc).

    ``scan``: the input as ``scan_input`` saw it (callers scan before taking the lock).
    ``lock``: the job's lock on the output, handed the rewritten file's lock.

    Raises:
        ChangedInputError: done ids whose request changed, without ``rerun_changed``.
        BatchError: the output cannot be read, repaired or rewritten.
    """
    scan = scan_input(input_path) if scan is None else scan
    try:
        state = read_output(output_path, repair=True)
    except OSError as exc:
        raise BatchError(f"cannot read the output file '{output_path}': {exc.strerror}") from None
    known: dict[Key, RecordInfo] = {}
    for key, info in state.records.items():
        if isinstance(key, tuple) and key[0] == "line":  # an id-less record from before request hashes
            key = scan.line_keys.get(int(key[1]), key)
        if key in scan.hashes:
            known[key] = info
    changed = [k for k, digest in scan.hashes.items()  # in input order
               if k in known and known[k].request_hash not in (None, digest)]
    if changed and not rerun_changed:
        listed = ", ".join(f"'{_name(k)}'" for k in changed[:MAX_LISTED_DUPLICATES])
        more = f" (and {len(changed) - MAX_LISTED_DUPLICATES} more)" if len(changed) > MAX_LISTED_DUPLICATES else ""
        raise ChangedInputError(f"{input_path}: {len(changed)} done id(s) have a different request (prompt or settings) "
                                f"than when their record was written: {listed}{more}; nothing was run. Rerun with "
                                "--rerun-changed to replace their records, or restore those lines")
    failed = {k for k, info in known.items() if not info.is_success} if retry_failed else set()
    drop = failed | set(changed)
    if drop:
        rewrite_without(output_path, drop, lock, scan.line_keys)
        known = {k: info for k, info in known.items() if k not in drop}
    return JobPlan(
        done=set(known), num_items=scan.num_items, num_todo=scan.num_items - len(known), num_lines=scan.num_lines,
        num_blank=scan.num_blank, num_retried=len(failed - set(changed)),
        changed=[_name(k) for k in changed[:MAX_LISTED_DUPLICATES]], num_changed=len(changed),
        num_done_failed=sum(not i.is_success for i in known.values()),
        num_done_retryable=sum(i.is_retryable for i in known.values()),
        num_legacy=sum(i.request_hash is None for i in known.values()),
        num_foreign=len(state.records) - len(known) - len(drop), torn_bytes=state.torn_bytes)


def iter_todo(input_path: str | Path, done: set[Key], scan: InputScan | None = None) -> Iterator[BatchItem]:
    """The input's items not in ``done``, each key once; with ``scan``, only the bytes and keys it saw."""
    seen: set[Key] = set()
    for item in iter_items(input_path, None if scan is None else scan.size):
        key = item.key
        if key not in done and key not in seen and (scan is None or key in scan.hashes):
            seen.add(key)
            yield item


class Progress:
    """Counts records as they are written and drives a tqdm bar (items/s and ETA)."""

    def __init__(self, total: int, enabled: bool = True, desc: str = "batch") -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="req", desc=desc, disable=not enabled, mininterval=0.5, dynamic_ncols=True)
        self.num_succeeded = 0
        self.num_failed = 0
        self.num_retryable = 0

    def record(self, record: dict) -> None:
        if is_success(record):
            self.num_succeeded += 1
        else:
            self.num_failed += 1
            self.num_retryable += is_retryable(record)
            self.bar.set_postfix(failed=self.num_failed, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def summary(plan: JobPlan, progress: Progress, input_path, output_path, seconds: float) -> dict:
    """The job's one-line JSON summary: this run's counts and the whole job's (``items_*``)."""
    ran = progress.num_succeeded + progress.num_failed
    items_failed = plan.num_done_failed + progress.num_failed
    return {
        "input": str(input_path), "output": str(output_path), "lines": plan.num_lines,
        "blank_lines": plan.num_blank, "items": plan.num_items,
        "skipped_done": len(plan.done), "retried": plan.num_retried, "rerun_changed": plan.num_changed, "ran": ran,
        "succeeded": progress.num_succeeded, "failed": progress.num_failed,
        "items_succeeded": len(plan.done) - plan.num_done_failed + progress.num_succeeded,
        "items_failed": items_failed,
        "items_failed_retryable": plan.num_done_retryable + progress.num_retryable,
        "items_missing": plan.num_items - len(plan.done) - ran,
        "torn_bytes_truncated": plan.torn_bytes, "foreign_records": plan.num_foreign,
        "legacy_records": plan.num_legacy,
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


@dataclass
class OpenJob:
    """A started job (``open_job``): its scan and plan, and ``record`` writing one output record to the locked
    output while counting it on the progress bar."""

    scan: InputScan
    plan: JobPlan
    writer: ResultWriter
    progress: Progress
    input_path: str | Path
    output_path: str | Path
    start: float

    def record(self, record: dict) -> None:
        """Append ``record`` to the output and count it."""
        self.writer.write(record)
        self.progress.record(record)

    def summary(self) -> dict:
        """The job's summary (``summary``), timed from ``open_job``."""
        return summary(self.plan, self.progress, self.input_path, self.output_path, time.perf_counter() - self.start)


@contextmanager
def open_job(input_path: str | Path, output_path: str | Path, *, retry_failed: bool = False,
             rerun_changed: bool = False, log: Callable[[str], None] | None = None, progress: bool = True,
             desc: str = "batch") -> Iterator[OpenJob]:
    """Steps 1-4 of the module doc, shared by the local and the Ray runner: refuse the input as output,
    scan the input, lock the output, plan; yields an ``OpenJob`` whose ``record`` appends to the locked
    output and drives a progress bar (``desc``). The lock is held and the bar shown until the block ends.

    Raises:
        BatchError (and its subclasses): the job cannot start; nothing was run.
    """
    start = time.perf_counter()
    check_not_same_file(input_path, output_path)
    scan = scan_input(input_path)  # duplicates refuse the job before anything is created
    with output_lock(output_path) as lock:
        check_not_same_file(input_path, output_path)  # the output may have been created as a link meanwhile
        plan = plan_job(input_path, output_path, retry_failed, scan, rerun_changed, lock)
        report_plan(plan, output_path, log)
        with ResultWriter(output_path) as writer:
            bar = Progress(plan.num_todo, enabled=progress, desc=desc)
            try:
                yield OpenJob(scan, plan, writer, bar, input_path, output_path, start)
            finally:
                bar.close()


def run_batch(
    input_path: str | Path,
    output_path: str | Path,
    make_serving: Callable[[], Any],
    *,
    retry_failed: bool = False,
    rerun_changed: bool = False,
    window: int = 16,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Run (or resume) a batch job locally; returns a summary dict (see ``summary``).

    Args:
        make_serving: builds an ``OpenAIServing`` (not started); called only when there is work.
        retry_failed: run the failed records again.
        rerun_changed: run the done ids whose request changed again (else they refuse the job).
        window: most requests in flight at once (about 2x the engine's ``max_num_seqs`` keeps it full).
        log: where one-line notices go (torn line truncated, failed records removed, ...).

    Raises:
        BatchError: the job could not start or a record could not be written (see ``open_job``).
        EngineUnavailableError: the engine died; the records written so far stay.
    """
    if window < 1:
        raise BatchError(f"the in-flight window must be >= 1, got {window}")
    with open_job(input_path, output_path, retry_failed=retry_failed, rerun_changed=rerun_changed, log=log,
                  progress=progress) as job:
        servings: list = []

        def get_serving():
            if not servings:
                servings.append(make_serving())
                servings[0].start()
            return servings[0]

        try:
            if job.plan.num_todo:
                asyncio.run(drive(get_serving, iter_todo(input_path, job.plan.done, job.scan), job.record, window))
        finally:
            for serving in servings:
                serving.stop()
    return job.summary()


def report_plan(plan: JobPlan, output_path, log: Callable[[str], None] | None) -> None:
    if log is None:
        return
    if plan.torn_bytes:
        log(f"{output_path}: truncated a torn last line ({plan.torn_bytes} bytes); its item will be run again")
    if plan.num_retried:
        log(f"{output_path}: removed {plan.num_retried} failed record(s); running them again")
    if plan.num_changed:
        log(f"{output_path}: removed {plan.num_changed} record(s) whose request changed "
            f"({', '.join(plan.changed)}{', ...' if plan.num_changed > len(plan.changed) else ''}); running them again")
    if plan.num_legacy:
        log(f"{output_path}: {plan.num_legacy} record(s) were written before request hashes existed; read as "
            "matching their input lines (an edit to those lines is not noticed)")
    if plan.num_foreign:
        log(f"{output_path}: {plan.num_foreign} record(s) have ids that are not in the input; kept as they are")
    blank = f" and {plan.num_blank} blank" if plan.num_blank else ""
    log(f"{plan.num_lines} lines ({plan.num_items} items{blank}): {len(plan.done)} already done, "
        f"{plan.num_todo} to run")
