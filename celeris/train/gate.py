"""Checkpoint gate: the held-out parse rate of stdlib function prompts, measured during training.

The issue's rule for self-distillation (dParallel arXiv:2509.26488 and d3LLM arXiv:2601.07568 both trade
quality for parallelism): every checkpoint is scored on prompts the model never trained on, and the export
takes the best-scoring one, not the last. The prompts are function headers with their docstrings cut from the
corpus's held-out split (``val.bin``), HumanEval-style; HumanEval itself is never used, so the benchmark stays
a test set. The score is the HumanEval harness's (``celeris.data.completions``: the greedy completion, cut at the
first line at column 0, must hold code and parse together with its prompt), and the function must gain a statement
that is not a string literal: a model that repeats triple quotes parses (adjacent strings join) and would score 1.0.
"""

from __future__ import annotations

import ast
import re
import textwrap

import numpy as np
import torch
from tokenizers import Tokenizer

from celeris.data.completions import cut_function_body, has_code, heal_prompt
from celeris.reference.autoregressive import generate_autoregressive
from celeris.sampling.params import SamplingParams

# a function header (any indentation) followed by an indented triple-quoted docstring
_FUNCTION = re.compile(r'^([ \t]*)def \w+\([^\n]*\)[^\n]*:\n\1[ \t]+(?:"""|\'\'\')[\s\S]*?(?:"""|\'\'\')\n', re.M)


def function_prompts(tokens: np.ndarray, tokenizer: Tokenizer, count: int, max_chars: int = 600) -> list[str]:
    """Up to ``count`` HumanEval-style prompts (header + docstring, moved to column 0) from held-out tokens.

    Args:
        tokens: 1-D uint16 token ids of the held-out split (documents joined by end-of-text).
        tokenizer: the corpus tokenizer.
        count: how many prompts; they are spread evenly over the matches, in text order (deterministic).
        max_chars: longer header + docstring matches are skipped.

    Returns:
        Prompts without trailing whitespace (``heal_prompt``), each ending in its docstring's closing quotes.
    """
    text = tokenizer.decode(tokens.astype(np.int64).tolist(), skip_special_tokens=False)
    found = [textwrap.dedent(m.group(0)) for m in _FUNCTION.finditer(text) if len(m.group(0)) <= max_chars]
    if not found or count < 1:
        return []
    picks = np.linspace(0, len(found) - 1, num=min(count, len(found))).round().astype(int)
    return [heal_prompt(found[i]) for i in dict.fromkeys(picks.tolist())]


@torch.no_grad()
def parse_rate(model: torch.nn.Module, tokenizer: Tokenizer, prompts: list[str], max_tokens: int = 128) -> float:
    """Share of ``prompts`` whose greedy next-token completion holds code, parses with its prompt and gives the
    function a statement that is not a string literal (``has_statement``).

    Greedy next-token decoding is what verified decoding outputs at temperature 0 (tested in
    tests/sampling/test_verified.py), so the gate scores the text the shipped model would print.

    Args:
        model: a causal Celeris model (``config.is_causal``); put back in its training mode afterwards.
        prompts: strings from ``function_prompts``.
        max_tokens: tokens per completion.

    Returns:
        Parse rate in [0, 1]; 0.0 for no prompts.

    Raises:
        ValueError: the model is not causal.
    """
    if not prompts:
        return 0.0
    was_training = model.training
    model.eval()
    params = SamplingParams(max_tokens=max_tokens, steps=max_tokens, block_length=max_tokens,
                            temperature=0.0)
    ids = [tokenizer.encode(p).ids for p in prompts]
    out = generate_autoregressive(model, ids, params)
    model.train(was_training)
    eos = model.config.eos_token_id
    ok = 0
    for prompt, answer in zip(prompts, out.token_ids, strict=True):
        answer = answer[: answer.index(eos)] if eos in answer else answer
        body = cut_function_body(tokenizer.decode(answer))
        ok += has_code(body) and has_statement(prompt + body)  # has_statement parses it (False if it does not)
    return ok / len(prompts)


def has_statement(source: str) -> bool:
    """Whether ``source`` parses and its last function has a statement besides string literals (its docstring, or a run of
    triple-quoted empty strings, which parses because Python joins adjacent strings: what a degenerate model repeats)."""
    try:
        functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    except (SyntaxError, ValueError):
        return False
    if not functions:
        return False
    last = max(functions, key=lambda n: n.lineno)
    return any(not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str))
               for s in last.body)
