"""The input file: the output given as the input (under any name), lines appended during a job,
request hashes, blank lines counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from celeris.batch.jobs import BatchError, iter_todo, parse_line, request_hash, run_batch, scan_input
from tests.batch.conftest import FakeServing, completion_body, read_records, write_jsonl


def good_rows(n: int) -> list[dict]:
    return [{"id": f"q{i}", "prompt": f"Once upon a time {i}", "max_tokens": 8, "temperature": 0} for i in range(n)]


def old_records(n: int) -> list[dict]:
    """Lines that look like a previous job's output (what a user passes by mistake as the input)."""
    return [{"id": f"batch_req_{i}", "custom_id": f"q{i}", "error": None,
             "response": {"status_code": 200, "request_id": "r", "body": completion_body("x")}} for i in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["same path", "symlink", "hard link"])
def test_output_that_is_the_input_is_refused(tmp_path, subprocess_env, name):
    """`celeris batch run out.jsonl out.jsonl` read back its own records forever (16,143 lines from 200)."""
    src = write_jsonl(tmp_path / "out.jsonl", old_records(20))
    out = {"same path": src, "symlink": tmp_path / "link.jsonl", "hard link": tmp_path / "hard.jsonl"}[name]
    if name == "symlink":
        out.symlink_to(src)
    elif name == "hard link":
        os.link(src, out)
    before = src.read_bytes()
    cmd = [sys.executable, "-m", "celeris.cli", "batch", "run", str(src), str(out), "--no-progress"]
    try:
        done = subprocess.run(cmd, env=subprocess_env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job did not stop; the file grew from {len(before)} to {src.stat().st_size} bytes")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "is the input file" in done.stderr, done.stderr
    assert src.read_bytes() == before


def test_lines_appended_during_the_job_are_not_part_of_it(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(3))
    out = tmp_path / "out.jsonl"

    def answer(body: dict) -> tuple[int, dict]:
        if len(fake.calls) == 1:  # another process appends to the input while the job runs
            with open(src, "a", encoding="utf-8") as fh:
                for i in range(3, 6):
                    fh.write(json.dumps({"id": f"q{i}", "prompt": f"late {i}"}) + "\n")
        return 200, completion_body("ok")

    fake = FakeServing(answer)
    summary = run_batch(src, out, lambda: fake, window=1, progress=False)
    assert sorted(r["custom_id"] for r in read_records(out)) == ["q0", "q1", "q2"]
    assert (summary["items"], summary["ran"], len(fake.calls)) == (3, 3, 3)
    again = run_batch(src, out, lambda: fake, progress=False)  # the next start sees them
    assert (again["items"], again["ran"]) == (6, 3)


def test_the_run_reads_the_bytes_the_scan_read(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"id": "a", "prompt": "x"}\n{"id": "b", "pro')  # the last line is still being written
    scan = scan_input(src)
    with open(src, "ab") as fh:
        fh.write(b'mpt": "y"}\n{"id": "c", "prompt": "z"}\n')
    assert (scan.num_items, scan.size) == (2, 43)
    items = list(iter_todo(src, set(), scan))
    assert [(i.custom_id, i.error_code) for i in items] == [("a", None), (None, "invalid_json")]


def test_request_hash_covers_the_request_not_its_spelling():
    short = parse_line(json.dumps({"id": "q", "prompt": "hi", "max_tokens": 4, "temperature": 0}), 1)
    openai = parse_line(json.dumps({"custom_id": "q", "method": "POST", "url": "/v1/completions",
                                    "body": {"temperature": 0, "max_tokens": 4, "prompt": "hi"}}), 7)
    assert short.request_hash == openai.request_hash == request_hash("/v1/completions", short.body, "")
    assert len(short.request_hash) == 64
    other_id = parse_line(json.dumps({"id": "r", "prompt": "hi", "max_tokens": 4, "temperature": 0}), 1)
    assert other_id.request_hash == short.request_hash  # the id is not part of the request
    for edit in ({"prompt": "hi!"}, {"temperature": 0.5}, {"seed": 1}):
        changed = parse_line(json.dumps({"id": "q", "prompt": "hi", "max_tokens": 4, "temperature": 0, **edit}), 1)
        assert changed.request_hash != short.request_hash, edit
    broken = parse_line('{"id": "q", "prompt"', 3)
    assert broken.error_code == "invalid_json" and broken.request_hash == request_hash(None, None, '{"id": "q", "prompt"')


def test_blank_lines_are_counted(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [*good_rows(2), "", "   ", *good_rows(3)[2:]])
    scan = scan_input(src)
    assert (scan.num_lines, scan.num_blank, scan.num_items) == (5, 2, 3)
    summary = run_batch(src, tmp_path / "out.jsonl", FakeServing, progress=False)
    assert (summary["lines"], summary["blank_lines"], summary["items"], summary["ran"]) == (5, 2, 3, 3)


def test_unreadable_input_is_a_batch_error(tmp_path):
    with pytest.raises(BatchError, match="cannot read the input file"):
        scan_input(tmp_path / "nope.jsonl")
