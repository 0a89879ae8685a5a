"""The prompt sets shipped in ``celeris/data``: each matches its SOURCE.md, is package data, and is what every
default reads (eval, bench, the load test, the batch example job), from any working directory, with no path that
exists only on the project's machines; a data path that does not exist is one line and exit code 2."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import tomllib
from pathlib import Path

import pytest

import celeris
from celeris import data

REPO = Path(celeris.__file__).resolve().parents[1]
SETS = {data.HUMANEVAL: ("MIT", 164), data.GSM8K: ("MIT", 1319), data.MT_BENCH: ("Apache", 80),
        data.TINYSTORIES: ("CDLA-Sharing-1.0", 100)}
SHARED = REPO.parent / "shared"


@pytest.mark.parametrize("path", list(SETS), ids=lambda p: p.parent.name)
def test_each_set_matches_its_source_md(path):
    source = (path.parent / "SOURCE.md").read_text(encoding="utf-8")
    licence, count = SETS[path]
    assert re.search(rf"Licence: {licence}", source)
    assert hashlib.sha256(path.read_bytes()).hexdigest() in source  # the file SOURCE.md describes, byte for byte
    assert len(data.read_jsonl(path)) == count
    if licence == "Apache":
        assert "Apache License" in (path.parent / "LICENSE-Apache-2.0.txt").read_text(encoding="utf-8")


@pytest.mark.skipif(not (SHARED / "data/tinystories").is_dir(), reason="needs ../shared/data/tinystories")
def test_the_summarisation_paragraphs_are_the_held_out_head_of_tinystories():
    """SOURCE.md's recipe rebuilds the shipped file, and the drafter's training prompts hold all of it out."""
    text = (SHARED / "data/tinystories/tinystories-valid-hf-export-head.txt").read_text(encoding="utf-8")
    paragraphs = [p.strip() for p in text.split("\n\n") if 200 <= len(p.strip()) <= 1200]
    shipped = [r["text"] for r in data.read_jsonl(data.TINYSTORIES)]
    assert shipped == paragraphs[:100]
    assert data.summarisation_prompts()[0] == f"{data.SUMMARISE}\n\n{shipped[0]}"
    trained = {m["content"] for row in drafter_data().prompts(SHARED, 300, 300, 0) for m in row["messages"]}
    assert not any(p in t for p in shipped for t in trained)


def drafter_data():  # noqa: ANN201 - the script's module
    """``scripts/drafter_data.py`` as a module (a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("drafter_data", REPO / "scripts/drafter_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeTokenizer:
    """A chat template and decoding over ids that are the characters' code points."""

    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> list[int]:
        return [ord(c) for c in messages[0]["content"]]

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return "".join(map(chr, ids))


def test_written_questions_are_kept_dropped_and_resumed_in_batches(tmp_path, monkeypatch):
    """``write_questions`` asks every (template, kind, subject) once, in batches of the generator's size: a reply
    with a question is kept, one without (no '?'), a repeat and an MT-Bench turn are stored empty, and a second
    call asks only what the first left (what a resumed data job does)."""
    module = drafter_data()
    monkeypatch.setattr(module, "ASK_TEMPLATES", ["About {subject}: {kind}"])
    monkeypatch.setattr(module, "QUESTION_KINDS", ["q", "no"])
    monkeypatch.setattr(module, "SUBJECTS", ["cats", "dogs", "tea"])
    mt_bench = next(t for t in sorted(module.mt_bench_turns()) if module.clean_question(t) == t and len(t) < 600)
    replies = {"About cats: q": "Why do cats purr?", "About dogs: q": "Why do cats purr?",  # a repeat
               "About tea: q": mt_bench, "About cats: no": "Sure, here is a poem."}
    calls = []

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        calls.append(len(prompts))
        asks = ["".join(map(chr, p)) for p in prompts]
        return [[ord(c) for c in replies.get(a, f"How is {a.replace(':', '')}?")] for a in asks]

    out = tmp_path / "questions.jsonl"
    monkeypatch.setattr(module, "SUBJECTS", ["cats", "dogs"])  # a first run over two subjects
    assert module.write_questions(generate, FakeTokenizer(), out, batch_size=3) == 2
    assert calls == [3, 1]
    monkeypatch.setattr(module, "SUBJECTS", ["cats", "dogs", "tea"])  # subjects added: only theirs are asked
    assert module.write_questions(generate, FakeTokenizer(), out, batch_size=3) == 3
    assert calls == [3, 1, 2]
    rows = {r["id"]: r["question"] for r in map(json.loads, out.read_text().splitlines())}
    assert rows == {"self-0-0-cats": "Why do cats purr?", "self-0-0-dogs": "", "self-0-0-tea": "",
                    "self-0-1-cats": "", "self-0-1-dogs": "How is About dogs no?",
                    "self-0-1-tea": "How is About tea no?"}


def test_every_shipped_file_is_package_data():
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["celeris"]
    for path in data.DATA_DIR.rglob("*"):
        if path.is_file() and path.suffix != ".py" and "__pycache__" not in path.parts:
            rel = path.relative_to(REPO / "celeris").as_posix()
            assert any(fnmatch.fnmatch(rel, g) for g in globs), rel


def test_defaults_resolve_inside_the_package_from_anywhere(tmp_path, monkeypatch):
    """A fresh clone has no ../shared: run from an empty folder; the defaults are the shipped sets."""
    from celeris.batch.examples import build_rows
    from celeris.bench.loadtest import load_prompts
    from celeris.bench.quality import load_humaneval
    from celeris.bench.run import BenchConfig
    from celeris.cli import build_parser

    monkeypatch.chdir(tmp_path)
    parser = build_parser()
    assert parser.parse_args(["eval", "humaneval"]).data is None and BenchConfig().prompts is None
    assert parser.parse_args(["bench"]).prompts is None
    assert [p["task_id"] for p in load_humaneval()[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert load_prompts("auto", 2) == [p["prompt"] for p in load_humaneval()[:2]]
    assert data.gsm8k_questions()[0].startswith("Janet") and len(data.mt_bench_questions()) == 80
    rows = build_rows(None, num=60)
    assert len(rows) == 60 and any('"id": "code-0001"' in r for r in rows)


def test_no_code_names_a_path_of_the_project_machines():
    for path in [*(REPO / "celeris").rglob("*.py"), *(REPO / "scripts").glob("*")]:
        if path.is_file():
            assert "shared/data" not in path.read_text(encoding="utf-8", errors="replace"), path


@pytest.mark.parametrize(("argv", "flag"), [(["eval", "humaneval", "--data", "no/such.jsonl.gz"], "--data"),
                                            (["bench", "--prompts", "no/such.jsonl.gz", "--no-smollm2"], "--prompts")])
def test_a_missing_data_path_is_one_line_and_exit_2(argv, flag, capsys):
    from celeris.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"celeris: error: {flag} no/such.jsonl.gz does not exist")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_examples_and_loadtest_say_a_missing_path_in_one_line(tmp_path, capsys):
    from celeris.batch.examples import main as examples
    from celeris.bench.loadtest import main as loadtest

    assert examples(["--data", str(tmp_path / "none"), "--out", str(tmp_path / "job.jsonl")]) == 2
    assert loadtest(["--url", "http://127.0.0.1:9", "--prompts", str(tmp_path / "p.jsonl")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all("does not exist" in line for line in lines), lines
    assert not (tmp_path / "job.jsonl").exists()
