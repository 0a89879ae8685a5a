"""Build the acceptance batch job: 1,000 requests from HumanEval (or TinyStories), MT-Bench and GSM8K, a few of
them bad.

    python -m celeris.batch.examples --out /tmp/celeris-accept/job.jsonl
    python -m celeris.batch.examples --data DIR --out /tmp/celeris-accept/job.jsonl

Writes ``job.jsonl`` (``--num`` lines in all) and ``job-dup.jsonl`` (the same plus one duplicated
id, which ``celeris batch run`` must refuse with exit code 2). The mix, in a fixed interleaved order:

* short-form completions ``{"id", "prompt", ...}``: by default HumanEval prompts (ids ``code-*``); with ``--data``,
  TinyStories openings (the first two sentences of stories that begin "Once upon a time"; ids ``story-*``);
* MT-Bench first turns (``turns[0]``) and GSM8K questions, as OpenAI Batch chat requests;
* planted bad lines, each of which must come back as its own error record while the rest runs:
  malformed JSON, an empty prompt, a prompt far over any context window (~60k words), a line
  without an id, an unknown url.

Every request asks for ``max_tokens`` (32) answer tokens, ``steps`` = ``max_tokens`` and
temperature 0, so a re-run gives the same answers. Prompts over ``MAX_PROMPT_CHARS`` characters are
left out so that the good requests fit a 512-token context window; a source that runs dry is filled up from the
others, in the mix's order.

By default the prompts are the sets shipped in ``celeris/data`` (``celeris.data``); ``--data DIR`` reads a folder
with ``tinystories/*.txt``, ``mt_bench/question.jsonl`` and ``gsm8k/test.jsonl`` instead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from celeris.data import existing, gsm8k_questions, humaneval_problems, mt_bench_questions

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


def _short(prompts: Iterable[str]) -> Iterator[str]:
    return (p for p in prompts if 0 < len(p) <= MAX_PROMPT_CHARS)


def prompt_sources(data: Path | None) -> tuple[str, dict[str, Iterator[str]]]:
    """(the completion kind, kind -> prompts): the shipped sets (``data`` None: HumanEval as ``code``) or the
    folder ``data`` (TinyStories as ``story``).

    Raises:
        celeris.data.MissingDataError: ``data`` or one of the files it must hold does not exist.
    """
    if data is None:
        texts = {"code": (p["prompt"] for p in humaneval_problems()), "gsm8k": gsm8k_questions(),
                 "mt_bench": mt_bench_questions()}
        return "code", {k: _short(v) for k, v in texts.items()}
    existing(data, "a folder with tinystories/, mt_bench/ and gsm8k/", "--data")
    stories = tinystories_openings(existing(data / "tinystories", "a folder of TinyStories .txt files"))
    texts = {"story": stories, "gsm8k": gsm8k_questions(data / "gsm8k" / "test.jsonl"),
             "mt_bench": mt_bench_questions(data / "mt_bench" / "question.jsonl")}
    return "story", {k: _short(v) for k, v in texts.items()}


def build_rows(data: Path | None = None, num: int = 1000, max_tokens: int = 32) -> list[str]:
    """The job's lines (JSON text; the malformed one as it is), ``num`` in all, from ``prompt_sources(data)``.

    Raises:
        celeris.data.MissingDataError: a data path does not exist. ValueError: too few prompts for ``num`` lines.
    """
    settings = {"max_tokens": max_tokens, "steps": max_tokens, "temperature": 0}
    completion, sources = prompt_sources(data)
    long_text = " ".join(itertools.repeat("Once upon a time there was a little dog named Max.", 6000))
    bad = [
        '{"id": "bad-json", "prompt": "Once upon a time", "max_tokens": ',
        json.dumps({"id": "bad-empty", "prompt": "", **settings}),
        json.dumps({"id": "bad-too-long", "prompt": long_text, **settings}),
        json.dumps({"prompt": "a line without an id", **settings}),
        json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
    ]
    good: list[str] = []
    # 10 lines in a round: 5 completions, 4 GSM8K, 1 MT-Bench (MT-Bench has only 80 questions)
    pattern = [completion] * 5 + ["gsm8k"] * 4 + ["mt_bench"]
    counters = dict.fromkeys(pattern, 0)
    for wanted in itertools.cycle(pattern):
        if len(good) >= num - len(bad):
            break
        for kind in [wanted, *pattern]:  # a source that ran dry: fill up from the others
            prompt = next(sources[kind], None)
            if prompt is not None:
                break
        else:
            where = "the shipped prompt sets" if data is None else str(data)
            raise ValueError(f"not enough prompts in {where} for {num} requests")
        counters[kind] += 1
        cid = f"{kind}-{counters[kind]:04d}"
        if kind == completion:
            good.append(json.dumps({"id": cid, "prompt": prompt, **settings}))
        else:
            body = {"messages": [{"role": "user", "content": prompt}], **settings}
            good.append(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}))
    rows = list(good)
    for i, line in enumerate(bad):  # spread the bad lines through the file
        rows.insert((i + 1) * len(rows) // (len(bad) + 1), line)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m celeris.batch.examples", description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="folder with tinystories/, mt_bench/, gsm8k/ (default: the prompt sets "
                                       "shipped in celeris/data, with HumanEval for the completions)")
    parser.add_argument("--out", required=True, help="job file to write; a -dup variant is written beside it")
    parser.add_argument("--num", type=int, default=1000, help="lines in the job (planted bad lines included)")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    try:
        rows = build_rows(None if args.data is None else Path(args.data), args.num, args.max_tokens)
    except (FileNotFoundError, ValueError) as exc:  # one line, no traceback
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
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
