"""The acceptance-job builder: line count, mix of sources, planted bad lines, the duplicate variant."""

from __future__ import annotations

import json

import pytest

from celeris.batch.examples import main
from celeris.batch.jobs import DuplicateIdError, iter_items, scan_input


@pytest.fixture
def data_dir(tmp_path):
    root = tmp_path / "data"
    (root / "tinystories").mkdir(parents=True)
    stories = [f"Once upon a time, there was a cat number {i}. It liked milk! It slept." for i in range(40)]
    (root / "tinystories" / "head.txt").write_text("\n\n".join(["Spot. Spot saw the car.", *stories]) + "\n")
    (root / "mt_bench").mkdir()
    (root / "mt_bench" / "question.jsonl").write_text(
        "".join(json.dumps({"question_id": i, "turns": [f"Write a poem {i}.", "Again."]}) + "\n" for i in range(5)))
    (root / "gsm8k").mkdir()
    (root / "gsm8k" / "test.jsonl").write_text(
        "".join(json.dumps({"question": f"What is {i} + {i}?", "answer": "#### 0"}) + "\n" for i in range(20)))
    return root


def test_builds_job_with_planted_bad_lines_and_duplicate_variant(data_dir, tmp_path, capsys):
    out = tmp_path / "job.jsonl"
    assert main(["--data", str(data_dir), "--out", str(out), "--num", "40", "--max-tokens", "16"]) == 0
    info = json.loads(capsys.readouterr().out)
    items = list(iter_items(out))
    assert len(items) == info["lines"] == 40
    assert scan_input(out).num_items == 40  # ids are unique
    errors = sorted(i.error_code for i in items if i.error_code)
    assert errors == ["invalid_json", "invalid_url", "missing_custom_id"]
    by_id = {i.custom_id: i for i in items if i.custom_id}
    assert by_id["bad-empty"].body["prompt"] == "" and len(by_id["bad-too-long"].body["prompt"]) > 100_000
    good = [i for i in items if i.error_code is None and not i.custom_id.startswith("bad-")]
    assert {i.custom_id.split("-")[0] for i in good} == {"story", "gsm8k", "mt_bench"}
    assert all(i.body["max_tokens"] == 16 and i.body["temperature"] == 0 for i in good)
    assert by_id["story-0001"].body["prompt"] == "Once upon a time, there was a cat number 0. It liked milk!"
    assert by_id["gsm8k-0001"].url == "/v1/chat/completions"
    with pytest.raises(DuplicateIdError, match="'story-0001' on lines 1, 41"):
        scan_input(info["duplicate_variant"])


def test_builds_job_from_the_shipped_sets_by_default(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no data folder anywhere near
    assert main(["--out", str(tmp_path / "job.jsonl"), "--num", "40", "--max-tokens", "8"]) == 0
    items = list(iter_items(json.loads(capsys.readouterr().out)["job"]))
    good = [i for i in items if i.error_code is None and not i.custom_id.startswith("bad-")]
    assert {i.custom_id.split("-")[0] for i in good} == {"code", "gsm8k", "mt_bench"}
    assert by_kind(good, "code")[0].body["prompt"].startswith("from typing import List")  # HumanEval/0
    assert by_kind(good, "gsm8k")[0].body["messages"][0]["content"].startswith("Janet")


def by_kind(items: list, kind: str) -> list:
    return [i for i in items if i.custom_id.startswith(kind + "-")]
