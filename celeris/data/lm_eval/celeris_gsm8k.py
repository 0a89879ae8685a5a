"""The datasets of the lm-evaluation-harness tasks in this folder, built offline from the GSM8K test set the package
ships (``celeris/data/gsm8k/test.jsonl``; its SOURCE.md gives the origin and licence).

The tasks use the file's last ``NUM_QUESTIONS`` questions: the drafter's training data held out the first 300 and the
bench and the batch example draw from the start, so none of them uses these. Loaded by lm-evaluation-harness as each
YAML's ``custom_dataset`` (``!function celeris_gsm8k.generation_docs``), so no hub download is needed
(``HF_DATASETS_OFFLINE=1``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NUM_QUESTIONS = 40
NUM_CHOICES = 4
SEED = 0
GSM8K = Path(__file__).resolve().parent.parent / "gsm8k" / "test.jsonl"


def final_answer(answer: str) -> str:
    """The number after GSM8K's ``#### `` marker, without thousands separators."""
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


def questions() -> list[dict]:
    """The last ``NUM_QUESTIONS`` GSM8K test records, each with its ``final`` answer."""
    lines = [line for line in GSM8K.read_text(encoding="utf-8").splitlines() if line.strip()]
    records = [json.loads(line) for line in lines[-NUM_QUESTIONS:]]
    return [{"question": r["question"], "answer": r["answer"], "final": final_answer(r["answer"])} for r in records]


def choice_records() -> list[dict]:
    """Multiple choice: each question's final answer among ``NUM_CHOICES - 1`` wrong ones (other questions' answers,
    distinct from it), in a fixed shuffled order; ``label`` is the right one's index."""
    docs = questions()
    rng = random.Random(SEED)
    finals = sorted({d["final"] for d in docs})
    out = []
    for d in docs:
        wrong = rng.sample([f for f in finals if f != d["final"]], NUM_CHOICES - 1)
        choices = [d["final"], *wrong]
        rng.shuffle(choices)
        out.append({**d, "choices": choices, "label": choices.index(d["final"])})
    return out


def _dataset(records: list[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(records)})


def generation_docs(**kwargs):
    """The generation task's dataset (``test`` split); lm-evaluation-harness passes its metadata as ``kwargs``."""
    return _dataset(questions())


def choice_docs(**kwargs):
    """The multiple-choice task's dataset (``test`` split)."""
    return _dataset(choice_records())
