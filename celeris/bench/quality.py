"""Quality checks for code completions: HumanEval prompts, `ast.parse` rate, repetition.

HumanEval (Chen et al. 2021, arXiv:2107.03374) prompts are real function
signatures with docstrings. A completion is cut at the end of the function (the
first non-empty line that starts at column 0); it must keep at least one line of
code (an empty body would let the docstring-only prompt parse on its own), and
``prompt + completion`` must be accepted by ``ast.parse``. This measures
syntactic validity, not correctness. The cut, code and parse rules and the prompt healing are
``celeris.data.completions`` (the training gate scores checkpoints by them too); they are importable from here.
"""

from __future__ import annotations

import time
from pathlib import Path

from celeris.data import humaneval_problems
from celeris.data.completions import cut_function_body, has_code, heal_prompt, parses
from celeris.llm import LLM
from celeris.sampling.params import SamplingParams


def load_humaneval(path: str | Path | None = None) -> list[dict]:
    """Problems of a HumanEval JSONL(.gz) file, in file order (None: the set shipped in ``celeris/data``).

    Raises:
        celeris.data.MissingDataError: ``path`` does not exist (a FileNotFoundError).
    """
    return humaneval_problems(path)


def max_repeat_run(token_ids: list[int]) -> int:
    """Length of the longest run of one identical token (0 for an empty list)."""
    best = run = 0
    prev = None
    for tid in token_ids:
        run = run + 1 if tid == prev else 1
        prev = tid
        best = max(best, run)
    return best


def fit_prompt(llm: LLM, prompt: str, params: SamplingParams) -> tuple[list[int], bool]:
    """Token ids of ``prompt``, left-truncated to fit the context window; (ids, truncated?)."""
    ids = llm.tokenizer.encode(prompt)
    room = llm.context_length - params.max_tokens
    return (ids[-room:], True) if len(ids) > room else (ids, False)


def evaluate_humaneval(llm: LLM, params: SamplingParams, problems: list[dict]) -> dict:
    """Complete every problem (batched by the engine) and score syntax and repetition.

    Prompts are healed (``heal_prompt``); prompts longer than the context window
    minus ``max_tokens`` are left-truncated for the model; the parse check
    always uses the full (healed) prompt.

    Returns:
        {"num_problems", "parse_rate", "num_truncated", "max_repeat_run",
         "num_repeat_over_8", "seconds", "results": [...]}.
    """
    start = time.perf_counter()
    prompts = [heal_prompt(p["prompt"]) for p in problems]
    fitted = [fit_prompt(llm, p, params) for p in prompts]
    requests = [llm.engine.add_request(ids, params) for ids, _ in fitted]
    while llm.engine.has_unfinished():
        llm.engine.step()
    results = []
    for problem, prompt, (_, truncated), request in zip(problems, prompts, fitted, requests, strict=True):
        out = llm.to_output(prompt, request)
        body = cut_function_body(out.text)
        results.append({
            "task_id": problem["task_id"], "completion": out.text, "cut": body, "truncated": truncated,
            "parses": has_code(body) and parses(prompt + body), "max_repeat_run": max_repeat_run(out.token_ids),
            "num_tokens": len(out.token_ids),
        })
    n = len(results)
    return {
        "num_problems": n,
        "parse_rate": sum(r["parses"] for r in results) / max(n, 1),
        "num_truncated": sum(r["truncated"] for r in results),
        "max_repeat_run": max((r["max_repeat_run"] for r in results), default=0),
        "num_repeat_over_8": sum(r["max_repeat_run"] > 8 for r in results),
        "seconds": round(time.perf_counter() - start, 2),
        "results": results,
    }
