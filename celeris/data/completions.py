"""How a code completion of a HumanEval-style prompt is scored: the rules of the HumanEval harness as Celeris
applies them (Chen et al. 2021, arXiv:2107.03374), shared by the benchmark (``celeris.bench.quality``) and the
training gate (``celeris.train.gate``).

A completion is cut at the end of the function (``cut_function_body``: the first non-empty line that starts at
column 0); it must keep a line of code (``has_code``) and ``prompt + completion`` must be accepted by
``ast.parse`` (``parses``). Prompts lose their trailing whitespace first (``heal_prompt``: token healing).
Plain string functions: nothing here imports the rest of Celeris.
"""

from __future__ import annotations

import ast


def cut_function_body(completion: str) -> str:
    """Keep the completion up to (not including) the first non-empty line at column 0."""
    kept = []
    for line in completion.split("\n"):
        if line.strip() and not line[0].isspace():
            break
        kept.append(line)
    return "\n".join(kept)


def has_code(body: str) -> bool:
    """Whether ``body`` holds a line that is neither blank nor a comment."""
    return any(line.strip() and not line.strip().startswith("#") for line in body.split("\n"))


def parses(source: str) -> bool:
    """Whether Python's ``ast.parse`` accepts ``source``."""
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


def heal_prompt(prompt: str) -> str:
    """The prompt without trailing whitespace, which the model then writes itself (token healing).

    The byte-level BPE merges a newline with the indentation after it, so a prompt
    that ends in a bare newline ends on a token the model has only seen before
    column-0 text; leaving the whitespace to the model avoids that boundary.
    """
    return prompt.rstrip()
