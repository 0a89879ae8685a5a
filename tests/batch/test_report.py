"""`celeris batch report` on a crafted results file: every count, the percentiles, JSON and PNG."""

from __future__ import annotations

import json

import pytest

from celeris.batch.report import OUTLIER_FACTOR, SHORT_CHARS, build_report, format_table
from celeris.cli import main
from tests.batch.conftest import completion_body


def ok(cid: str, text: str, tokens: int = 8) -> dict:
    return {"id": f"batch_req_{cid}", "custom_id": cid, "error": None,
            "response": {"status_code": 200, "request_id": "r", "body": completion_body(text, completion_tokens=tokens)}}


def chat_ok(cid: str, text: str) -> dict:
    body = {"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}
    return {"id": f"batch_req_{cid}", "custom_id": cid, "error": None,
            "response": {"status_code": 200, "request_id": "r", "body": body}}


def http_error(cid: str, status: int, code: str | None, kind: str = "invalid_request_error") -> dict:
    body = {"error": {"message": "m", "type": kind, "param": None, "code": code}}
    return {"id": f"batch_req_{cid}", "custom_id": cid, "error": None,
            "response": {"status_code": status, "request_id": "r", "body": body}}


def line_error(cid: str | None, code: str, line: int | None = None) -> dict:
    record = {"id": "batch_req_e", "custom_id": cid, "response": None, "error": {"code": code, "message": "m"}}
    if line is not None:
        record["line"] = line
    return record


@pytest.fixture
def results(tmp_path):
    normal = [ok(f"n{i}", "x" * (38 + i)) for i in range(6)]  # lengths 38..43
    records = normal + [
        chat_ok("chat", "y" * 40),
        ok("empty", ""),
        ok("blank", "  \n "),
        ok("short", " hi "),
        ok("dup1", "The same answer, twice over."),
        ok("dup2", "The same answer, twice over."),
        ok("dup3", "The same answer, twice over."),
        ok("long", "z" * 400),  # > p50 * 4
        ok("tiny", "abcdefgh"),  # < p50 / 4 (~10): an outlier, but not too short
        http_error("ctx", 400, "context_length_exceeded"),
        http_error("val", 400, "invalid_value"),
        http_error("val2", 400, "invalid_value"),
        http_error("boom", 500, None, kind="server_error"),
        http_error("weird", 502, None, kind=""),
        line_error(None, "invalid_json", line=17),
        line_error("url", "invalid_url"),
        ok("redo", "first try"),  # superseded by the next record for the same id
        ok("redo", "y" * 41),
    ]
    path = tmp_path / "results.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in records) + '{"id": "batch_req_torn", "custom_'  # a torn tail
    path.write_text(text)
    return path


def test_report_counts(results):
    rep = build_report(results)
    assert rep["records"] == 23  # the superseded record and the torn line are not counted
    assert rep["duplicate_records"] == 1 and rep["unreadable_lines"] == 1
    assert (rep["succeeded"], rep["failed"]) == (16, 7)
    assert rep["errors"] == {"invalid_value": 2, "context_length_exceeded": 1, "server_error": 1, "http_502": 1,
                             "invalid_json": 1, "invalid_url": 1}
    assert rep["outputs"] == 16
    assert rep["empty_outputs"]["count"] == 2 and set(rep["empty_outputs"]["ids"]) == {"empty", "blank"}
    assert rep["too_short_outputs"]["ids"] == ["short"] and SHORT_CHARS == 5
    assert rep["duplicate_outputs"]["count"] == 3 and rep["duplicate_outputs"]["groups"] == 1
    assert sorted(rep["duplicate_outputs"]["examples"][0]["ids"]) == ["dup1", "dup2", "dup3"]
    # non-empty lengths: 38..43, 40 (chat), 4 (short), 28 x3 (dups), 400, 8, 41 (redo)
    lengths = sorted(rep["lengths"])
    assert lengths == sorted([38, 39, 40, 41, 42, 43, 40, 4, 28, 28, 28, 400, 8, 41])
    assert rep["length_chars"]["p50"] == 39.5 and rep["length_chars"]["max"] == 400
    assert rep["outliers"]["low"] == 39.5 / OUTLIER_FACTOR and rep["outliers"]["high"] == 39.5 * OUTLIER_FACTOR
    assert sorted(rep["outliers"]["ids"]) == ["long", "short", "tiny"]
    assert rep["finish_reasons"] == {"length": 15, "stop": 1}
    assert rep["length_tokens"]["p50"] == 8
    table = format_table(rep)
    assert "succeeded" in table and "context_length_exceeded" in table and "outliers" in table


def test_report_cli_writes_json_and_png(results, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "report.json", tmp_path / "lengths.png"
    assert main(["batch", "report", str(results), "--json", str(out_json), "--plot", str(out_png)]) == 0
    assert "failed" in capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert data["succeeded"] == 16 and "lengths" not in data
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_of_missing_file_is_a_one_line_error(tmp_path, capsys):
    assert main(["batch", "report", str(tmp_path / "nope.jsonl")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_report_of_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    rep = build_report(path)
    assert rep["records"] == 0 and rep["length_chars"]["p50"] is None and rep["outliers"]["count"] == 0
    format_table(rep)


def test_report_with_input_counts_missing_and_extra(results, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": k, "prompt": "p"}) + "\n" for k in ["n0", "n1", "gone"]) + '{"bad\n')
    rep = build_report(results, src)
    assert rep["input_items"] == 4
    assert rep["missing"] == {"count": 2, "ids": ["gone", "<line 4>"]}
    assert rep["extra"]["count"] == rep["records"] - 2
    assert "missing (no record)" in format_table(rep)


def test_headline_states_duplicated_and_foreign_records(results, tmp_path, capsys):
    """Duplicated and foreign records were only hinted at by a trailing "superseded" row."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": k, "prompt": "p"}) + "\n" for k in ["n0", "n1", "redo"]))
    rep = build_report(results, src)
    assert rep["headline"].startswith("24 records for 23 ids: 1 duplicated")
    assert f"{rep['records'] - 3} foreign" in rep["headline"]
    assert main(["batch", "report", str(results), "--input", str(src)]) == 0
    first_line = capsys.readouterr().out.splitlines()[0]
    assert "1 duplicated" in first_line and "foreign" in first_line
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join(json.dumps(ok(k, "a fine answer")) + "\n" for k in ["n0", "n1", "redo"]))
    expected = "3 records for 3 ids: one record per input item, none duplicated or foreign"
    assert build_report(clean, src)["headline"] == expected


def test_lines_without_an_id_are_matched_by_request_hash(tmp_path):
    """A report with --input keyed id-less lines by line number: deleting a line above them made them
    look missing and their records foreign."""
    from celeris.batch.jobs import run_batch
    from tests.batch.conftest import FakeServing

    rows = [json.dumps({"id": "a", "prompt": "p"}), json.dumps({"prompt": "no id"}), '{"broken']
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out.jsonl"
    run_batch(src, out, FakeServing, progress=False)
    src.write_text("\n".join(rows[1:]) + "\n")  # "a" deleted: the id-less lines move up
    rep = build_report(out, src)
    assert rep["missing"]["count"] == 0 and rep["extra"]["ids"] == ["a"]
