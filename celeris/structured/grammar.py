"""Grammars for constrained decoding, compiled by llguidance (https://github.com/guidance-ai/llguidance).

A grammar is llguidance's own text form (a Lark grammar, where ``%json {...}`` embeds a JSON Schema); it is
built here from OpenAI's ``response_format`` and ``tools``/``tool_choice`` and carried in
``SamplingParams.grammar``. ``Constraint`` follows one answer token by token and gives, before every token,
the (V,) boolean mask of the tokens the grammar accepts next (the end-of-text token only where the grammar
may end), so masked decoding can only produce text that the grammar derives.

JSON is compiled without free whitespace (``whitespace_flexible: False``: the compact form ``{"a":1}``), so
a model can never spend its budget on spaces.
"""

from __future__ import annotations

import json
from functools import lru_cache

import numpy as np
import torch

try:  # an optional import at module load: the error names the package when a grammar is first asked for
    import llguidance as llg
except ImportError:  # pragma: no cover - llguidance is a dependency in pyproject.toml
    llg = None

JSON_OPTIONS = {"whitespace_flexible": False}
# Completion within the budget (``Constraint.settle``): while at most CLOSING_WINDOW tokens are left, every
# state keeps a greedy closing path no longer than the tokens left; a sampled token after which none is found is
# replaced by the current path's next token. A token is checked only when the tokens left are at most the current
# path's length plus MARGIN (a token that opens more than MARGIN tokens of obligations is not seen coming).
CLOSING_WINDOW, MARGIN = 256, 64
# Characters the closing path prefers, in order: the ones that end a string, an object, an array or a number.
CLOSERS = '"}],:01a'

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


class GrammarError(ValueError):
    """A schema or tool definition that cannot be turned into a grammar; ``param`` names the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _lib():
    if llg is None:
        raise GrammarError("structured output needs the 'llguidance' package: pip install llguidance")
    return llg


def check_schema(schema: object, param: str) -> dict:
    """``schema`` as a dict after checking it is a valid JSON Schema (Draft 2020-12 meta-schema, ``jsonschema``).

    Raises:
        GrammarError: not an object, or not a valid schema (message names ``param``).
    """
    import jsonschema

    if not isinstance(schema, dict):
        raise GrammarError(f"'{param}' must be a JSON Schema object, got {type(schema).__name__}", param)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise GrammarError(f"'{param}' is not a valid JSON Schema: {exc.message}", param) from None
    return schema


def _validated(grammar: str, param: str) -> str:
    err = _lib().LLMatcher.validate_grammar(grammar)
    if err:
        raise GrammarError(f"'{param}' cannot be enforced: {err}", param)
    return grammar


def schema_grammar(schema: object, param: str = "response_format.json_schema.schema") -> str:
    """The grammar of the compact JSON texts that validate against ``schema``.

    Raises:
        GrammarError: an invalid schema, or a feature llguidance does not enforce (e.g. an unknown ``format``).
    """
    schema = check_schema(schema, param)
    try:
        grammar = _lib().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"'{param}' cannot be enforced: {exc}", param) from None
    return _validated(grammar, param)


def json_object_grammar() -> str:
    """``response_format: {"type": "json_object"}``: any JSON object."""
    return schema_grammar({"type": "object"}, "response_format")


def call_schema(name: str, parameters: dict) -> dict:
    """The JSON Schema of one call ``{"name": name, "arguments": <parameters>}``."""
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_grammar(functions: dict[str, dict], parallel: bool = True) -> str:
    """The grammar of one (``parallel``: one or more) Hermes-style call(s) of the ``functions`` (name ->
    parameters schema): ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, one per line.

    Raises:
        GrammarError: a parameters schema that cannot be enforced (param ``tools``).
    """
    if not functions:
        raise GrammarError("no function to call", "tools")
    for name, params in functions.items():
        check_schema(params, f"tools[{name}].function.parameters")
    alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
    lines = [f'start: {"calls" if parallel else "call"}',
             'calls: call ("\\n" call)*',
             f'call: "{TOOL_CALL_OPEN}" body "{TOOL_CALL_CLOSE}"',
             f"body: {alternatives}"]
    for i, (name, params) in enumerate(functions.items()):
        schema = {**call_schema(name, params), "x-guidance": JSON_OPTIONS}  # llguidance's compile options, inline
        lines.append(f"call_{i}: %json {json.dumps(schema)}")
    return _validated("\n".join(lines) + "\n", "tools")


@lru_cache(maxsize=8)
def _grammar_tokenizer(tokenizer_json: str, eos_id: int, vocab_size: int):
    return _lib().LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_id)


def grammar_tokenizer(tokenizer, vocab_size: int | None = None):
    """llguidance's view of a ``celeris.tokenizer.Tokenizer`` (cached): its ``tokenizer.json`` and end-of-text
    id, over ``vocab_size`` ids (default: the tokenizer's; a model may have more rows than the tokenizer).
    None when llguidance is not installed or cannot read this tokenizer (constrained requests are then refused)."""
    if llg is None or not hasattr(tokenizer, "_tok"):
        return None
    try:
        return _grammar_tokenizer(tokenizer._tok.to_str(), tokenizer.eos_token_id,
                                  max(vocab_size or 0, tokenizer.vocab_size))
    except (ValueError, RuntimeError):  # a tokenizer.json llguidance does not support
        return None


def _bits(matcher) -> np.ndarray:
    """(tokenizer vocab rounded up to 32,) bool: the tokens ``matcher`` accepts next."""
    return np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little").astype(bool)


def _closer_ids(tokenizer) -> list[int]:
    """The token ids of the single characters of ``CLOSERS`` that are one token each, in that order."""
    ids = []
    for ch in CLOSERS:
        toks = tokenizer.tokenize_str(ch)
        if len(toks) == 1:
            ids.append(toks[0])
    return ids


class Constraint:
    """One answer's grammar state.

    Args:
        grammar: a grammar from this module (``SamplingParams.grammar``).
        tokenizer: ``grammar_tokenizer(...)``.

    Raises:
        GrammarError: the grammar does not compile for this tokenizer.
    """

    def __init__(self, grammar: str, tokenizer) -> None:
        self.matcher = _lib().LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {self.matcher.get_error()}")
        self.vocab_size = tokenizer.vocab_size
        self.eos_id = tokenizer.eos_token
        self.closers = _closer_ids(tokenizer)
        self._path: list[int] | None = None  # the closing path from the current state, when known
        self._next: tuple[int, list[int] | None] | None = None  # (a checked token, the path after it)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (only the end-of-text token)."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete sentence of the grammar."""
        return self.matcher.is_accepting()

    def allowed(self, vocab_size: int, remaining: int | None = None) -> torch.Tensor:
        """(vocab_size,) bool: the tokens the grammar accepts next; ids past the tokenizer's are never allowed.

        ``remaining``: answer positions left, this one included; when it equals the closing path's length
        (``settle``), only the path's next token. After an error (which masked decoding never causes), only
        the end-of-text id.
        """
        out = torch.zeros(vocab_size, dtype=torch.bool)
        if self.matcher.is_error():
            out[self.eos_id] = True
            return out
        if self._path and remaining is not None and remaining <= len(self._path):
            out[self._path[0]] = True
            return out
        n = min(vocab_size, self.vocab_size)
        out[:n] = torch.from_numpy(_bits(self.matcher)[:n])
        return out

    def settle(self, token_id: int, remaining: int) -> int:
        """The token to commit for the sampled ``token_id`` with ``remaining`` positions left (this one
        included): ``token_id``, unless the answer could then no longer be closed within the budget while the
        current state can, in which case the current closing path's next token (``CLOSING_WINDOW``)."""
        if remaining > CLOSING_WINDOW or self.matcher.is_stopped():
            return token_id
        if self._path is None:
            self._path = self.closing_path(remaining)
        path = self._path
        if path is None or (path and path[0] == token_id) or remaining > len(path) + MARGIN:
            return token_id
        after = self.matcher.deep_copy()
        if not after.consume_token(int(token_id)):
            return token_id
        self._next = (token_id, self.closing_path(remaining - 1, after))
        return token_id if self._next[1] is not None else path[0]

    def closing_path(self, limit: int, matcher=None) -> list[int] | None:
        """A short sequence of tokens (at most ``limit``) that completes the text so far, ending with the
        end-of-text id unless the grammar stops by itself; None if none was found. Greedy: at each position
        the end-of-text id if allowed, else the first allowed of ``CLOSERS``, else the lowest allowed id."""
        m = (matcher or self.matcher).deep_copy()
        path: list[int] = []
        while len(path) < limit:
            if m.is_stopped():
                return path
            bits = _bits(m)
            if self.eos_id < bits.size and bits[self.eos_id]:
                return path + [self.eos_id]
            pick = next((t for t in self.closers if bits[t]), None)
            if pick is None:
                ids = np.flatnonzero(bits)
                if ids.size == 0:
                    return None
                pick = int(ids[0])
            if not m.consume_token(pick):
                return None
            path.append(pick)
        return None

    def consume(self, token_id: int) -> bool:
        """Advance by one committed token; False when the grammar rejects it (never under masking)."""
        if self._path and self._path[0] == token_id:
            self._path = self._path[1:]
        elif self._next is not None and self._next[0] == token_id:
            self._path = self._next[1]
        else:
            self._path = None
        self._next = None
        if self.matcher.is_stopped():
            return token_id == self.eos_id
        return bool(self.matcher.consume_token(int(token_id)))


def row_constraints(rows: list, tokenizer) -> list[Constraint | None]:
    """One ``Constraint`` per row of ``SamplingParams`` whose ``grammar`` is set (None for the others).

    Raises:
        ValueError: a row has a grammar but no ``tokenizer`` (llguidance's) was given.
    """
    if any(r.grammar is not None for r in rows) and tokenizer is None:
        raise ValueError("a grammar needs the tokenizer: pass grammar_tokenizer (celeris.structured.grammar_tokenizer)")
    return [None if r.grammar is None else Constraint(r.grammar, tokenizer) for r in rows]


def allowed_rows(constraints: list[Constraint | None], width: int, vocab_size: int,
                 device: torch.device | str, remaining: list[int] | None = None) -> torch.Tensor | None:
    """(B, width, V) bool mask for a step whose blocks are one token wide: row i's column 0 takes its grammar's
    mask (the other columns are padding), rows without a constraint allow everything; None when no row has one.
    ``remaining``: per row, the answer positions left (this one included), for the budget rule (``settle``)."""
    if all(c is None for c in constraints):
        return None
    mask = torch.ones((len(constraints), width, vocab_size), dtype=torch.bool)
    for i, c in enumerate(constraints):
        if c is not None:
            mask[i, 0] = c.allowed(vocab_size, None if remaining is None else remaining[i])
    return mask.to(device)


# Caches that recompute the masked suffix at every block's first step: with blocks of one token, at every step.
SUFFIX_CACHES = ("prefix", "dual", "dual_delayed")


def constrained_settings(defaults: dict, block_length: int | None, cache: str | None) -> dict[str, object]:
    """The ``block_length`` and ``cache`` a request with a grammar is decoded with, given the model's
    generation defaults and the request's own values (None: not set). Blocks are one token (the grammar
    applies left to right); a cache the request did not choose that would recompute the whole masked suffix at
    every token (``SUFFIX_CACHES``) becomes ``delayed`` (each token's keys/values are computed once, a step after
    it is committed), unless the defaults use a ``suffix_window`` (which ``delayed`` cannot go with)."""
    out: dict[str, object] = {"block_length": 1 if block_length is None else block_length}
    if cache is None and defaults.get("cache") in SUFFIX_CACHES and not defaults.get("suffix_window"):
        out["cache"] = "delayed"
    return out
