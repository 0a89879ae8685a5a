"""Build the acceptance batch job: 1,000 requests from TinyStories, MT-Bench and GSM8K, a few of them bad.

    python -m celeris.batch.examples --data ../shared/data --out /tmp/celeris-accept/job.jsonl

Writes ``job.jsonl`` (``--num`` lines in all) and ``job-dup.jsonl`` (the same plus one duplicated
id, which ``celeris batch run`` must refuse with exit code 2). The mix, in a fixed interleaved order:

* TinyStories openings (the first two sentences of stories that begin "Once upon a time"), as
  short-form completions ``{"id", "prompt", ...}``;
* MT-Bench first turns (``turns[0]``) and GSM8K questions, as OpenAI Batch chat requests;
* planted bad lines, each of which must come back as its own error record while the rest runs:
  malformed JSON, an empty prompt, a prompt far over any context window (~60k words), a line
  without an id, an unknown url.

Every request asks for ``max_tokens`` (32) answer tokens, ``steps`` = ``max_tokens`` and
temperature 0, so a re-run gives the same answers. Prompts over ``MAX_PROMPT_CHARS`` characters are
left out so that the good requests fit a 512-token context window.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_PROMPT_CHARS = 800
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def tinystories_openings(folder: Path) -> Iterator[str]:
    """First two sentences of every blank-line block that starts a story ("Once upon a time")."""
    for path in sorted(folder.glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        for block in text.split("\n\n"):
            block = " ".join(block.split())
            if block.startswith("Once upon a time"):
                yield " ".join(SENTENCE_END.split(block)[:2])


def mt_bench_questions(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)["turns"][0]


def gsm8k_questions(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)["question"]


def _short(prompts: Iterator[str]) -> Iterator[str]:
    return (p for p in prompts if 0 < len(p) <= MAX_PROMPT_CHARS)


def build_rows(data: Path, num: int = 1000, max_tokens: int = 32) -> list[str]:
    """The job's lines (JSON text; the malformed one as it is), ``num`` in all."""
    settings = {"max_tokens": max_tokens, "steps": max_tokens, "temperature": 0}
    stories = _short(tinystories_openings(data / "tinystories"))
    mt_bench = _short(mt_bench_questions(data / "mt_bench" / "question.jsonl"))
    gsm8k = _short(gsm8k_questions(data / "gsm8k" / "test.jsonl"))
    long_text = " ".join(itertools.repeat("Once upon a time there was a little dog named Max.", 6000))
    bad = [
        '{"id": "bad-json", "prompt": "Once upon a time", "max_tokens": ',
        json.dumps({"id": "bad-empty", "prompt": "", **settings}),
        json.dumps({"id": "bad-too-long", "prompt": long_text, **settings}),
        json.dumps({"prompt": "a line without an id", **settings}),
        json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
    ]
    good: list[str] = []
    # 10 lines in a round: 5 stories, 4 GSM8K, 1 MT-Bench (MT-Bench has only 80 questions)
    pattern = ["story"] * 5 + ["gsm8k"] * 4 + ["mt_bench"]
    counters = dict.fromkeys(pattern, 0)
    sources = {"story": stories, "gsm8k": gsm8k, "mt_bench": mt_bench}
    for kind in itertools.cycle(pattern):
        if len(good) >= num - len(bad):
            break
        prompt = next(sources[kind], None)
        if prompt is None:
            kind, prompt = "story", next(stories, None)  # a source ran dry: fill up with stories
            if prompt is None:
                raise SystemExit(f"not enough prompts in {data} for {num} requests")
        counters[kind] += 1
        cid = f"{kind}-{counters[kind]:04d}"
        if kind == "story":
            good.append(json.dumps({"id": cid, "prompt": prompt, **settings}))
        else:
            body = {"messages": [{"role": "user", "content": prompt}], **settings}
            good.append(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}))
    rows = list(good)
    for i, line in enumerate(bad):  # spread the bad lines through the file
        rows.insert((i + 1) * len(rows) // (len(bad) + 1), line)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data", help="folder with tinystories/, mt_bench/, gsm8k/")
    parser.add_argument("--out", required=True, help="job file to write; a -dup variant is written beside it")
    parser.add_argument("--num", type=int, default=1000, help="lines in the job (planted bad lines included)")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    rows = build_rows(Path(args.data), args.num, args.max_tokens)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    dup = out.with_name(f"{out.stem}-dup{out.suffix}")
    first = json.loads(rows[0])
    dup_line = json.dumps({"id": first.get("id") or first.get("custom_id"), "prompt": "the same id again",
                           "max_tokens": args.max_tokens})
    dup.write_text("".join(r + "\n" for r in rows) + dup_line + "\n", encoding="utf-8")
    print(json.dumps({"job": str(out), "lines": len(rows), "duplicate_variant": str(dup),
                      "duplicate_id": json.loads(dup_line)["id"], "duplicate_lines": [1, len(rows) + 1]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
