"""Batch jobs in-process: validation, one record per line, resume, torn-line recovery, retry of failures."""

from __future__ import annotations

import json

import pytest

from celeris.batch.jobs import (
    BatchError,
    ChangedInputError,
    DuplicateIdError,
    EngineUnavailableError,
    output_lock,
    parse_line,
    read_output,
    run_batch,
)
from celeris.cli import main
from celeris.engine.scheduler import Scheduler
from tests.batch.conftest import (
    MODEL_NAME,
    FakeServing,
    answer_text,
    by_id,
    completion_body,
    read_records,
    write_jsonl,
)

LONG_PROMPT = "Once upon a time there was a little girl named Lily. " * 30  # far over the 128-token window


def good_rows(n: int, max_tokens: int = 8) -> list[dict]:
    return [{"id": f"q{i}", "prompt": f"Once upon a time {i}", "max_tokens": max_tokens, "temperature": 0}
            for i in range(n)]


def never_called():
    raise AssertionError("the job built a serving layer although nothing was left to run")


# ---------------------------------------------------------------------------------------------
# Input forms and malformed lines


def test_parse_short_and_openai_forms():
    item = parse_line(json.dumps({"id": 7, "prompt": "hi", "max_tokens": 4, "seed": 1}), 3)
    assert (item.custom_id, item.url, item.body) == ("7", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "seed": 1})
    item = parse_line(json.dumps({"id": "c", "messages": [{"role": "user", "content": "hi"}]}), 1)
    assert item.url == "/v1/chat/completions" and item.body == {"messages": [{"role": "user", "content": "hi"}]}
    row = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}
    item = parse_line(json.dumps(row), 1)
    assert (item.custom_id, item.url, item.body, item.error_code) == ("x", row["url"], row["body"], None)
    for text, code in [
        ('{"id": "a", "prompt": "x"', "invalid_json"),
        ("[1, 2]", "invalid_json"),
        ('{"prompt": "x"}', "missing_custom_id"),
        ('{"id": "", "prompt": "x"}', "missing_custom_id"),
        ('{"custom_id": "a", "url": "/v1/embeddings", "body": {}}', "invalid_url"),
        ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', "invalid_method"),
        ('{"custom_id": "a", "url": "/v1/completions", "body": "x"}', "invalid_body"),
        ('{"id": "a", "prompt": "x", "messages": []}', "invalid_request"),
        ('{"id": "a", "max_tokens": 3}', "invalid_request"),
    ]:
        item = parse_line(text, 9)
        assert item.error_code == code, text
        assert item.error_message.startswith("line 9: ")


def test_malformed_empty_and_overlong_lines_get_own_records_rest_succeed(tmp_path, make_serving):
    rows = good_rows(4) + [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 8}},
        '{"id": "broken", "prompt": "no closing brace"',
        {"prompt": "a line without an id"},
        {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"id": "empty", "prompt": ""},
        {"id": "long", "prompt": LONG_PROMPT, "max_tokens": 8},
        {"id": "badparam", "prompt": "hi", "max_tokens": 8, "temperature": "hot"},
        "",  # blank lines are skipped, not records
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    summary = run_batch(src, out, make_serving, window=8, progress=False)
    records = by_id(read_records(out))
    assert summary["items"] == len(records) == 11
    assert (summary["succeeded"], summary["failed"]) == (5, 6)
    for key in ["q0", "q1", "q2", "q3", "chat"]:
        response = records[key]["response"]
        assert records[key]["error"] is None and response["status_code"] == 200
        assert response["body"]["model"] == MODEL_NAME and response["request_id"]
        assert isinstance(answer_text(records[key]), str)
    assert records["chat"]["response"]["body"]["object"] == "chat.completion"
    # lines that never became requests: response null, error {code, message}
    assert records["line6"]["error"]["code"] == "invalid_json" and records["line6"]["response"] is None
    assert records["line7"]["error"]["code"] == "missing_custom_id"
    assert records["emb"]["error"]["code"] == "invalid_url"
    # requests the server refuses keep the server's 4xx answer
    assert records["empty"]["response"]["status_code"] == 400
    assert records["empty"]["response"]["body"]["error"]["param"] == "prompt"
    assert records["long"]["response"]["status_code"] == 400
    assert records["long"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert records["badparam"]["response"]["body"]["error"]["param"] == "temperature"
    for record in records.values():
        assert record["id"].startswith("batch_req_")


def test_duplicate_ids_refuse_the_job_with_line_numbers(tmp_path, capsys):
    rows = good_rows(3) + [{"id": "q1", "prompt": "again"}, {"id": "q2", "prompt": "again"}, {"id": "q1", "prompt": "3"}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    with pytest.raises(DuplicateIdError) as info:
        run_batch(src, out, never_called, progress=False)
    assert "'q1' on lines 2, 4, 6" in str(info.value) and "'q2' on lines 3, 5" in str(info.value)
    assert not out.exists() and not (tmp_path / "out.jsonl.lock").exists()
    # the command line: exit code 2, one line on stderr, before any model is loaded
    code = main(["batch", "run", str(src), str(out), "--model", str(tmp_path)])  # never loaded
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert err.count("\n") == 1 and "duplicate id" in err and "lines 2, 4, 6" in err


def test_numeric_and_string_ids_collide(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "a"}, {"id": "1", "prompt": "b"}])
    with pytest.raises(DuplicateIdError, match="lines 1, 2"):
        run_batch(src, tmp_path / "out.jsonl", never_called, progress=False)


# ---------------------------------------------------------------------------------------------
# Resume, torn lines, retry


def test_rerun_skips_done_ids_and_loads_nothing(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(5))
    out = tmp_path / "out.jsonl"
    first = run_batch(src, out, FakeServing, progress=False)
    before = out.read_bytes()
    again = run_batch(src, out, never_called, progress=False)
    assert (first["ran"], again["ran"], again["skipped_done"]) == (5, 0, 5)
    assert out.read_bytes() == before


def test_resume_runs_only_missing_ids(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(6))
    out = tmp_path / "out.jsonl"
    run_batch(src, out, FakeServing, progress=False)
    lines = out.read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if json.loads(ln)["custom_id"] not in ("q1", "q4")]
    out.write_text("".join(kept))
    fake = FakeServing()
    summary = run_batch(src, out, lambda: fake, progress=False)
    assert sorted(c["prompt"] for c in fake.calls) == ["Once upon a time 1", "Once upon a time 4"]
    assert summary["ran"] == 2 and sorted(by_id(read_records(out))) == [f"q{i}" for i in range(6)]


@pytest.mark.parametrize("tail", [b'{"id": "batch_req_1", "custom_id": "q', b'{"custom_id": "q2", "resp\n'])
def test_torn_last_line_is_truncated_and_its_item_redone(tmp_path, make_serving, tail):
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(4))
    out = tmp_path / "out.jsonl"
    run_batch(src, out, make_serving, progress=False)
    reference = {k: answer_text(r) for k, r in by_id(read_records(out)).items()}
    lines = out.read_bytes().splitlines(keepends=True)
    lost = json.loads(lines[-1])["custom_id"]
    out.write_bytes(b"".join(lines[:-1]) + tail)  # the last record was being written when the job died
    state = read_output(out, repair=False)
    assert state.torn_bytes == len(tail) and lost not in state.status

    summary = run_batch(src, out, make_serving, progress=False)
    assert summary["torn_bytes_truncated"] == len(tail) and summary["ran"] == 1
    assert [c["prompt"] for c in make_serving.built[-1].calls] == [f"Once upon a time {lost[1:]}"]
    records = by_id(read_records(out))  # every line is JSON again, one record per id
    assert {k: answer_text(r) for k, r in records.items()} == reference  # greedy: the redone answer is the same


def test_damaged_middle_line_is_refused(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(3))
    out = tmp_path / "out.jsonl"
    run_batch(src, out, FakeServing, progress=False)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + "garbage\n" + "".join(lines[1:]))
    with pytest.raises(BatchError, match="line 2 is not valid JSON"):
        run_batch(src, out, never_called, progress=False)


def test_retry_failed_reruns_only_failed_and_keeps_one_record_per_id(tmp_path, make_serving):
    rows = good_rows(5) + [{"id": "long", "prompt": LONG_PROMPT, "max_tokens": 8}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    run_batch(src, out, make_serving, progress=False)
    # plant two more failures the way they look on disk: an engine error (500) and a record without response
    records = read_records(out)
    for r in records:
        if r["custom_id"] == "q1":
            r["response"] = {"status_code": 500, "request_id": "r", "body": {"error": {"message": "boom",
                             "type": "server_error", "param": None, "code": "engine_error"}}}
        if r["custom_id"] == "q3":
            r["response"], r["error"] = None, {"code": "internal_error", "message": "simulated"}
    write_jsonl(out, records)
    good_before = {r["custom_id"]: r for r in records if r["custom_id"] in ("q0", "q2", "q4")}

    plain = run_batch(src, out, never_called, progress=False)  # without --retry-failed failures are final
    assert plain["ran"] == 0

    summary = run_batch(src, out, make_serving, retry_failed=True, progress=False)
    rerun = sorted(c["prompt"][:20] for c in make_serving.built[-1].calls)
    assert rerun == sorted(["Once upon a time 1", "Once upon a time 3", LONG_PROMPT[:20]])
    assert (summary["retried"], summary["ran"], summary["succeeded"], summary["failed"]) == (3, 3, 2, 1)
    final = by_id(read_records(out))  # exactly one record per id
    assert sorted(final) == ["long", "q0", "q1", "q2", "q3", "q4"]
    assert final["q1"]["response"]["status_code"] == 200 and final["q3"]["error"] is None
    assert all(final[k] == good_before[k] for k in good_before)  # successes untouched
    assert final["long"]["response"]["body"]["error"]["code"] == "context_length_exceeded"


def test_started_items_are_not_done_after_engine_failure(tmp_path):
    """A request in flight when the engine dies leaves no record, so the next start runs it."""
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(6))
    out = tmp_path / "out.jsonl"

    def answer(body):
        if body["prompt"].endswith(" 3"):
            return 503, {"error": {"message": "engine crashed", "type": "server_error", "code": "engine_unavailable"}}
        return 200, completion_body("fine")

    with pytest.raises(EngineUnavailableError):
        run_batch(src, out, lambda: FakeServing(answer, delay=0.01), window=2, progress=False)
    assert "q3" not in by_id(read_records(out))
    run_batch(src, out, FakeServing, progress=False)
    assert sorted(by_id(read_records(out))) == [f"q{i}" for i in range(6)]


# ---------------------------------------------------------------------------------------------
# Concurrency


def test_window_keeps_engine_full_but_bounded(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(40))
    fake = FakeServing(delay=0.005)
    run_batch(src, tmp_path / "out.jsonl", lambda: fake, window=6, progress=False)
    assert fake.max_in_flight == 6 and fake.started and fake.stopped


def test_queue_full_is_waited_out_not_recorded(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(2))
    seen: dict[str, int] = {}

    def answer(body):
        seen[body["prompt"]] = seen.get(body["prompt"], 0) + 1
        if seen[body["prompt"]] <= 2:
            return 429, {"error": {"message": "full", "type": "rate_limit_error", "code": "queue_full"}}
        return 200, completion_body("ok")

    summary = run_batch(src, tmp_path / "out.jsonl", lambda: FakeServing(answer), progress=False)
    assert summary["succeeded"] == 2 and set(seen.values()) == {3}


def test_concurrency_is_bounded_on_the_real_engine(tmp_path, make_serving, monkeypatch):
    """The job keeps the engine's rows full (batched, not one by one) and never above ``max_num_seqs``.

    Counted from the scheduled batches, not from the number of steps: how many steps a row runs alone before the
    next arrives depends on the machine's load (46 steps > 45 failed once on a loaded machine)."""
    sizes: list[int] = []
    schedule = Scheduler.schedule

    def recording(self):  # noqa: ANN001, ANN202 - wraps Scheduler.schedule
        batch = schedule(self)
        sizes.append(len(batch))
        return batch

    monkeypatch.setattr(Scheduler, "schedule", recording)
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(10))
    out = tmp_path / "out.jsonl"
    summary = run_batch(src, out, lambda: make_serving(max_num_seqs=2), window=4, progress=False)
    assert summary["succeeded"] == 10
    assert max(sizes) == 2  # bounded by max_num_seqs, and two rows did run in one step


def test_second_job_on_same_output_is_refused(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(1))
    out = tmp_path / "out.jsonl"
    with output_lock(out), pytest.raises(BatchError, match="another batch job"):
        run_batch(src, out, never_called, progress=False)


def test_only_malformed_lines_load_no_model(tmp_path):
    rows = ['{"id": "a"', {"prompt": "no id"}, {"custom_id": "u", "url": "/x", "body": {}}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    summary = run_batch(src, out, never_called, progress=False)
    assert (summary["ran"], summary["failed"]) == (3, 3)
    assert [r["error"]["code"] for r in read_records(out)] == ["invalid_json", "missing_custom_id", "invalid_url"]


# ---------------------------------------------------------------------------------------------
# Edited inputs (request_hash)


def edit_rows(rows: list[dict], edits: dict[str, dict]) -> list[dict]:
    return [{**row, **edits.get(row["id"], {})} for row in rows]


def test_edited_done_ids_refuse_the_job_naming_them(tmp_path, capsys, fake_engine):
    """An edited prompt or setting kept its stale answer silently ("5 already done, 0 to run")."""
    rows = good_rows(5)
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    run_batch(src, out, FakeServing, progress=False)
    assert all(len(r["request_hash"]) == 64 for r in read_records(out))
    write_jsonl(src, edit_rows(rows, {"q1": {"prompt": "A new prompt"}, "q3": {"temperature": 0.7}}))
    before = out.read_bytes()
    with pytest.raises(ChangedInputError, match="2 done id\\(s\\).*'q1', 'q3'.*--rerun-changed"):
        run_batch(src, out, never_called, progress=False)
    assert out.read_bytes() == before
    assert main(["batch", "run", str(src), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'q1', 'q3'" in err and out.read_bytes() == before
    assert main(["batch", "run", str(src), str(out), "--no-progress", "--rerun-changed"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["rerun_changed"], summary["ran"]) == (2, 2)


def test_rerun_changed_replaces_only_the_edited_records(tmp_path):
    rows = good_rows(5)
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    run_batch(src, out, FakeServing, progress=False)
    kept = {k: r for k, r in by_id(read_records(out)).items() if k not in ("q1", "q3")}
    write_jsonl(src, edit_rows(rows, {"q1": {"prompt": "A new prompt"}, "q3": {"temperature": 0.7}}))
    fake = FakeServing()
    notes: list[str] = []
    summary = run_batch(src, out, lambda: fake, rerun_changed=True, progress=False, log=notes.append)
    assert sorted(c["prompt"] for c in fake.calls) == ["A new prompt", "Once upon a time 3"]
    assert (summary["rerun_changed"], summary["ran"], summary["skipped_done"]) == (2, 2, 3)
    assert any("2 record(s) whose request changed (q1, q3)" in n for n in notes), notes
    final = by_id(read_records(out))  # one record per id
    assert answer_text(final["q1"]) == "echo: A new prompt"
    assert all(final[k] == r for k, r in kept.items())
    assert run_batch(src, out, never_called, progress=False)["ran"] == 0  # and now they match


def test_records_without_a_hash_are_read_as_matching_with_a_note(tmp_path):
    rows = good_rows(4) + [{"prompt": "no id"}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    run_batch(src, out, FakeServing, progress=False)
    legacy = [{k: v for k, v in r.items() if k != "request_hash"} for r in read_records(out)]  # an older file
    write_jsonl(out, legacy)
    write_jsonl(src, edit_rows(rows[:4], {"q2": {"prompt": "edited"}}) + rows[4:])
    notes: list[str] = []
    summary = run_batch(src, out, never_called, progress=False, log=notes.append)
    assert (summary["ran"], summary["skipped_done"], summary["legacy_records"], summary["foreign_records"]) == (0, 5, 5, 0)
    assert any("5 record(s) were written before request hashes existed" in n for n in notes), notes


def test_deleting_a_line_does_not_rekey_lines_without_an_id(tmp_path):
    """Lines without an id were keyed by line number: deleting a line above them ran them again."""
    rows = [*good_rows(3), {"prompt": "no id"}, '{"broken', *good_rows(5)[3:], {"prompt": "no id"}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    first = run_batch(src, out, FakeServing, progress=False)
    assert first["ran"] == 8
    write_jsonl(src, rows[1:])  # q0 deleted: every later line moves up by one
    summary = run_batch(src, out, never_called, progress=False)
    assert (summary["items"], summary["ran"], summary["skipped_done"], summary["foreign_records"]) == (7, 0, 7, 1)
    assert len(read_records(out)) == 8


# ---------------------------------------------------------------------------------------------
# Exit codes and summaries


@pytest.fixture
def fake_engine(monkeypatch):
    """`celeris batch run` with a FakeServing in place of a model: 500 for prompts ending in "boom",
    a context error for those ending in "long", an echo otherwise."""
    from celeris.serve.serving import OpenAIServing

    def answer(body):
        prompt = body["prompt"]
        if prompt.endswith("boom"):
            return 500, {"error": {"message": "boom", "type": "server_error", "param": None, "code": "engine_error"}}
        if prompt.endswith("long"):
            return 400, {"error": {"message": "too long", "type": "invalid_request_error", "param": "prompt",
                                   "code": "context_length_exceeded"}}
        return 200, completion_body(f"echo: {prompt}")

    monkeypatch.setattr(OpenAIServing, "from_model", classmethod(lambda cls, *a, **k: FakeServing(answer)))


def run_cli(src, out, capsys, *extra: str) -> tuple[int, dict, str]:
    code = main(["batch", "run", str(src), str(out), "--no-progress", *extra])
    captured = capsys.readouterr()
    return code, json.loads(captured.out.strip().splitlines()[-1]), captured.err


def test_exit_code_3_when_lines_failed_and_every_line_counted(tmp_path, capsys, fake_engine):
    """10 of 12 lines failed and the job exited 0; blank lines were not counted."""
    rows = good_rows(2) + [f'{{"id": "b{i}", "prompt"' for i in range(8)] + ["", ""]
    rows += [{"id": "x1", "prompt": "far too long"}, {"id": "x2", "messages": "?", "prompt": "p"}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    code, summary, err = run_cli(src, tmp_path / "out.jsonl", capsys)
    assert code == 3
    assert (summary["lines"], summary["blank_lines"], summary["items"]) == (14, 2, 12)
    assert (summary["items_succeeded"], summary["items_failed"], summary["items_failed_retryable"]) == (2, 10, 0)
    assert "10 can never succeed as written" in err and "--retry-failed" not in err  # retrying cannot help them
    code, summary, _ = run_cli(src, tmp_path / "out.jsonl", capsys)  # nothing left to run: still 3
    assert (code, summary["ran"], summary["items_failed"]) == (3, 0, 10)

    ok = write_jsonl(tmp_path / "ok.jsonl", good_rows(3) + [""])
    code, summary, _ = run_cli(ok, tmp_path / "ok-out.jsonl", capsys)
    assert (code, summary["items_succeeded"], summary["lines"]) == (0, 3, 4)


def test_retry_failed_is_suggested_only_for_failures_a_retry_can_fix(tmp_path, capsys, fake_engine):
    rows = good_rows(2) + [{"id": "e", "prompt": "goes boom"}, {"id": "c", "prompt": "far too long"}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    code, summary, err = run_cli(src, tmp_path / "out.jsonl", capsys)
    assert code == 3 and (summary["items_failed"], summary["items_failed_retryable"]) == (2, 1)
    assert "1 can never succeed as written" in err and "1 may succeed on another try" in err
    assert "--retry-failed" in err


def test_setting_for_a_rule_not_chosen_is_a_failed_record(tmp_path, make_serving):
    """Issue 16 item 3 in batch jobs: the line's 400 names both settings; the other lines run."""
    rows = [*good_rows(1), {"id": "rule", "prompt": "hi", "max_tokens": 8, "threshold": 0.2},
            {"id": "default", "prompt": "hi", "max_tokens": 8, "threshold": 0.9}]  # issue 28 item 4: the default too
    out = tmp_path / "out.jsonl"
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), out, make_serving, window=8, progress=False)
    records = by_id(read_records(out))
    assert (summary["succeeded"], summary["failed"]) == (1, 2)
    for line in ("rule", "default"):
        error = records[line]["response"]["body"]["error"]
        assert records[line]["response"]["status_code"] == 400 and error["param"] == "threshold"
        assert "decoding='fixed'" in error["message"]


def test_structured_output_in_batch_records_validates(tmp_path, make_serving):
    """Batch lines take response_format as the server does (the same code path): every answer validates."""
    import jsonschema

    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 50}},
              "required": ["k", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "kn", "schema": schema}}
    rows = [{"id": f"s{i}", "prompt": f"Once upon a time {i}", "max_tokens": 48, "temperature": 0.7, "seed": i,
             "response_format": fmt} for i in range(3)]
    rows.append({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 48,
                          "response_format": fmt}})
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    summary = run_batch(src, out, make_serving, window=4, progress=False)
    assert summary["succeeded"] == 4
    for record in by_id(read_records(out)).values():
        assert record["response"]["body"]["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(answer_text(record)), schema)
