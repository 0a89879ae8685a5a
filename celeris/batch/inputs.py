"""The input file of a batch job: parse its lines, key them, hash their requests, check for duplicates.

See ``celeris.batch.jobs`` for the two input forms and what ``request_hash`` covers. A job reads only
the input's bytes present when it started (``InputScan.size``), so lines appended meanwhile (or the
job's own output, were it the input) are never part of it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celeris.batch.output import BatchError, Key

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
MAX_LISTED_DUPLICATES = 10


class DuplicateIdError(BatchError):
    """Some custom_ids appear on more than one line; nothing was run."""


# ---------------------------------------------------------------------------------------------
# Input


def request_hash(url: str | None, body: dict | None, text: str) -> str:
    """SHA-256 hex of ``{"url", "body"}`` as canonical JSON; of ``text`` stripped when there is no request."""
    if url is None or body is None:
        payload = "line:" + text.strip()
    else:
        payload = json.dumps({"url": url, "body": body}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


@dataclass(slots=True)
class BatchItem:
    """One input line.

    Attributes:
        line_no: 1-based line number in the input file.
        custom_id: the request's id; None when the line has no usable one.
        url: the endpoint ("/v1/completions" or "/v1/chat/completions").
        body: the OpenAI request body.
        error_code / error_message: set when the line cannot become a request.
        request_hash: see ``request_hash``; set by ``parse_line``.
        occurrence: for a line without an id, how many earlier id-less lines have the same hash.
    """

    line_no: int
    custom_id: str | None
    url: str | None = None
    body: dict[str, Any] | None = None
    error_code: str | None = None
    error_message: str | None = None
    request_hash: str = ""
    occurrence: int = 0

    @property
    def key(self) -> Key:
        return self.custom_id if self.custom_id is not None else ("anon", f"{self.request_hash}:{self.occurrence}")

    def to_json(self) -> str:
        return json.dumps({"line": self.line_no, "custom_id": self.custom_id, "url": self.url, "body": self.body,
                           "request_hash": self.request_hash})

    @classmethod
    def from_json(cls, text: str) -> BatchItem:
        d = json.loads(text)
        return cls(d["line"], d["custom_id"], d["url"], d["body"], request_hash=d["request_hash"])


def _coerce_id(value: Any) -> str | None:
    """A usable id: a non-empty string, or an integer (kept as its decimal string)."""
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def _parse(text: str, line_no: int) -> BatchItem:
    """Parse one input line, without its hash; never raises."""

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


def parse_line(text: str, line_no: int) -> BatchItem:
    """Turn one input line (OpenAI Batch format or short form) into a BatchItem with its
    ``request_hash``; never raises."""
    item = _parse(text, line_no)
    item.request_hash = request_hash(item.url if item.error_code is None else None, item.body, text)
    return item


@dataclass(slots=True)
class InputScan:
    """The input as the job saw it when it started.

    Attributes:
        hashes: key -> request hash of every non-blank line.
        line_keys: line number -> key of the lines without an id (to read records written before
            request hashes existed, which name such lines by number).
        num_lines: every line, blank or not.
        num_blank: blank lines (counted, never run).
        size: bytes read; later reads stop there, so lines appended meanwhile are not part of the job.
    """

    hashes: dict[Key, str] = field(default_factory=dict)
    line_keys: dict[int, Key] = field(default_factory=dict)
    num_lines: int = 0
    num_blank: int = 0
    size: int = 0

    @property
    def num_items(self) -> int:
        return len(self.hashes)


def iter_lines(path: str | Path, size: int | None = None) -> Iterator[tuple[int, str]]:
    """(1-based number, text) of every line of the input's first ``size`` bytes (all of it when None)."""
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise BatchError(f"cannot read the input file '{path}': {exc.strerror}") from None
    with handle:
        left = os.fstat(handle.fileno()).st_size if size is None else size
        line_no = 0
        while left > 0:
            raw = handle.readline(left)
            if not raw:
                break
            left -= len(raw)
            line_no += 1
            yield line_no, raw.decode("utf-8", errors="replace")


def _with_occurrence(item: BatchItem, anon: Counter[str]) -> BatchItem:
    """Number the id-less lines of one request hash in file order (their keys)."""
    if item.custom_id is None:
        item.occurrence = anon[item.request_hash]
        anon[item.request_hash] += 1
    return item


def iter_items(path: str | Path, size: int | None = None) -> Iterator[BatchItem]:
    """Stream the input file's non-blank lines (of its first ``size`` bytes) as BatchItems."""
    anon: Counter[str] = Counter()
    for line_no, line in iter_lines(path, size):
        if line.strip():
            yield _with_occurrence(parse_line(line, line_no), anon)


def scan_input(path: str | Path) -> InputScan:
    """Read the input once as it is now; raises DuplicateIdError naming every duplicated id and its lines."""
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise BatchError(f"cannot read the input file '{path}': {exc.strerror}") from None
    scan = InputScan(size=size)
    first_line: dict[Key, int] = {}
    duplicates: dict[str, list[int]] = {}
    anon: Counter[str] = Counter()
    for line_no, line in iter_lines(path, size):
        scan.num_lines = line_no
        if not line.strip():
            scan.num_blank += 1
            continue
        item = _with_occurrence(parse_line(line, line_no), anon)
        key = item.key
        if key in first_line:
            duplicates.setdefault(str(key), [first_line[key]]).append(item.line_no)
            continue
        first_line[key] = item.line_no
        scan.hashes[key] = item.request_hash
        if item.custom_id is None:
            scan.line_keys[item.line_no] = key
    if duplicates:
        listed = "; ".join(f"'{cid}' on lines {', '.join(map(str, lines))}"
                           for cid, lines in list(duplicates.items())[:MAX_LISTED_DUPLICATES])
        more = f" (and {len(duplicates) - MAX_LISTED_DUPLICATES} more)" if len(duplicates) > MAX_LISTED_DUPLICATES else ""
        raise DuplicateIdError(f"{path}: {len(duplicates)} duplicate id(s), nothing was run: {listed}{more}")
    return scan


def check_not_same_file(input_path: str | Path, output_path: str | Path) -> None:
    """Refuse an output that is the input file under any name (itself, a symlink, a hard link): the
    job would read back the records it appends."""
    try:
        same = os.path.samefile(input_path, output_path)
    except OSError:  # one of them does not exist (yet): not the same file
        return
    if same:
        raise BatchError(f"the output '{output_path}' is the input file '{input_path}' (the same file"
                         f"{'' if str(input_path) == str(output_path) else ' under another name'}); "
                         "give another output path")
