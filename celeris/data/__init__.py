"""The prompt sets Celeris uses by default, shipped inside the package (each folder's ``SOURCE.md`` gives the
origin, the exact version and the licence):

- ``humaneval/HumanEval.jsonl.gz``: HumanEval's 164 problems (MIT), for ``celeris eval humaneval``,
  ``celeris bench`` and the load test;
- ``gsm8k/test.jsonl``: GSM8K's 1,319 test problems (MIT), and ``mt_bench/question.jsonl``: MT-Bench's 80 questions
  (Apache-2.0), for the batch example job and the bench's prompt sets;
- ``tinystories/paragraphs.jsonl``: 100 TinyStories paragraphs (CDLA-Sharing-1.0), the bench's summarisation set.

Every reader takes an optional ``path`` (a user's own copy, e.g. ``--data``) and raises ``MissingDataError`` (one
line naming it) when that path does not exist.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
HUMANEVAL = DATA_DIR / "humaneval" / "HumanEval.jsonl.gz"
GSM8K = DATA_DIR / "gsm8k" / "test.jsonl"
MT_BENCH = DATA_DIR / "mt_bench" / "question.jsonl"
TINYSTORIES = DATA_DIR / "tinystories" / "paragraphs.jsonl"
SUMMARISE = "Summarise in one sentence:"


class MissingDataError(FileNotFoundError):
    """A data path the caller gave does not exist; the message is one line naming it (and ``what`` it should be)."""


def existing(path: str | Path, what: str = "file", option: str | None = None) -> Path:
    """``path`` as a Path, checked to exist.

    Raises:
        MissingDataError: "<option> <path> does not exist (expected <what>)".
    """
    path = Path(path)
    if not path.exists():
        name = f"{option} {path}" if option else str(path)
        raise MissingDataError(f"{name} does not exist (expected {what})")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSON Lines file (``.gz``: gzip-compressed), in file order; blank lines are skipped.

    Raises:
        MissingDataError: ``path`` does not exist.
    """
    path = existing(path, "a JSON Lines file")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def humaneval_problems(path: str | Path | None = None) -> list[dict]:
    """HumanEval problems (``task_id``, ``prompt``, ``entry_point``, ...), in file order (default: the shipped set)."""
    return read_jsonl(HUMANEVAL if path is None else path)


def gsm8k_questions(path: str | Path | None = None) -> list[str]:
    """GSM8K questions (the ``question`` field), in file order (default: the shipped test set)."""
    return [r["question"] for r in read_jsonl(GSM8K if path is None else path)]


def mt_bench_questions(path: str | Path | None = None) -> list[str]:
    """MT-Bench first turns (``turns[0]``), in file order (default: the shipped questions)."""
    return [r["turns"][0] for r in read_jsonl(MT_BENCH if path is None else path)]


def summarisation_prompts(path: str | Path | None = None) -> list[str]:
    """Summarisation requests: ``SUMMARISE``, a blank line, then a TinyStories paragraph (the ``text`` field), in
    file order (default: the shipped 100 paragraphs)."""
    return [f"{SUMMARISE}\n\n{r['text']}" for r in read_jsonl(TINYSTORIES if path is None else path)]
