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
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from celeris.structured.finite import has_finite_value

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
    """``schema`` as a dict after checking it is a valid JSON Schema (Draft 2020-12 meta-schema, ``jsonschema``)
    that some finite value may validate against (``celeris.structured.finite.has_finite_value``).

    Raises:
        GrammarError: not an object, not a valid schema, or one no finite value validates (message names ``param``).
    """
    import jsonschema

    if not isinstance(schema, dict):
        raise GrammarError(f"'{param}' must be a JSON Schema object, got {type(schema).__name__}", param)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise GrammarError(f"'{param}' is not a valid JSON Schema: {exc.message}", param) from None
    if not has_finite_value(schema):
        raise GrammarError(f"'{param}' admits no finite JSON value: every value would have to contain itself "
                           "(a '$ref' that recurses without a way out) or a required part is 'false'", param)
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


def check_parameters(schema: object, param: str) -> dict:
    """A function's ``parameters`` as a dict after checking it is a valid JSON Schema whose ``type`` is
    ``"object"`` (a call's arguments are a JSON object; OpenAI refuses any other parameters schema likewise).

    Raises:
        GrammarError: not a valid schema, or not of type "object" (message names ``param``).
    """
    schema = check_schema(schema, param)
    if schema.get("type") != "object":
        raise GrammarError(f"'{param}' must be a JSON Schema of type \"object\" (a call's arguments are a JSON "
                           f"object), got type {json.dumps(schema.get('type'))}", param)
    return schema


def call_rules(index: int, name: str, parameters: dict) -> list[str]:
    """The grammar rules of one call ``{"name":<name>,"arguments":<parameters>}`` (compact JSON): the name as a
    literal and the arguments as a JSON Schema of their own (``args_<index>: %json``), so that the schema's
    ``$ref``s (``#/$defs/...``, ``#``) resolve against the parameters themselves, as they were written, not
    against a call object they were embedded in."""
    head = json.dumps(f'{{"name":{json.dumps(name)},"arguments":')  # a Lark string literal
    args = json.dumps({**parameters, "x-guidance": JSON_OPTIONS})  # llguidance's compile options, inline
    return [f'call_{index}: {head} args_{index} "}}"', f"args_{index}: %json {args}"]


# ``tool_choice: "auto"``'s other branch: free text (at least one character) in which the call tag never occurs,
# so an answer is either nothing but valid calls or text that cannot be mistaken for a broken call (llguidance's
# lexeme intersection ``&`` and negation ``~`` in a token definition, docs/syntax.md of llguidance).
FREE_TEXT = "/(.|\\n)+/ & ~/(.|\\n)*" + TOOL_CALL_OPEN + "(.|\\n)*/"


def tool_call_grammar(functions: dict[str, dict], parallel: bool = True, alternative: str | dict | None = None) -> str:
    """The grammar of one (``parallel``: one or more) Hermes-style call(s) of the ``functions`` (name ->
    parameters schema): ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, one per line.

    ``alternative`` (``tool_choice: "auto"``): the calls or, instead, ``"text"`` (``FREE_TEXT``: any text without
    the call tag) or the compact JSON of a schema (a dict: ``response_format`` beside the tools).

    Raises:
        GrammarError: a parameters schema that is not an object schema or cannot be enforced (param ``tools``).
    """
    if not functions:
        raise GrammarError("no function to call", "tools")
    for name, params in functions.items():
        check_parameters(params, f"tools[{name}].function.parameters")
    alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
    answer = "calls" if parallel else "call"
    if alternative is None:
        lines = [f"start: {answer}"]
    elif alternative == "text":
        lines = [f"start: {answer} | TEXT", f"TEXT: {FREE_TEXT}"]
    else:
        lines = [f"start: {answer} | other", f"other: %json {json.dumps({**alternative, 'x-guidance': JSON_OPTIONS})}"]
    lines += ['calls: call ("\\n" call)*', f'call: "{TOOL_CALL_OPEN}" body "{TOOL_CALL_CLOSE}"', f"body: {alternatives}"]
    for i, (name, params) in enumerate(functions.items()):
        lines += call_rules(i, name, params)
    return _validated("\n".join(lines) + "\n", "tools")


def stops_apply(grammar: str | None, text: str) -> bool | None:
    """Whether stop strings may end an answer ``text`` decoded under ``grammar``: stop strings only end free text,
    never the text a grammar constrains (a stop string inside JSON or a call would leave it invalid).

    True without a grammar; False under a grammar that constrains the whole answer (JSON, forced calls); under
    ``tool_choice: "auto"``'s grammar (calls or ``FREE_TEXT``): False once ``text`` starts with the call tag, True
    once it cannot, None while it is a proper prefix of the tag (undecided: a finished answer is then text)."""
    if grammar is None:
        return True
    if FREE_TEXT not in grammar:
        return False
    if text.startswith(TOOL_CALL_OPEN):
        return False
    return None if TOOL_CALL_OPEN.startswith(text) else True


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


@lru_cache(maxsize=64)
def _start_problem(grammar: str, tokenizer) -> str | None:
    matcher = _lib().LLMatcher(tokenizer, grammar, log_level=0)
    if not matcher.is_error():
        bits = _bits(matcher)  # the first mask: llguidance finds some errors only when it computes one
        if not matcher.is_error():
            others = np.flatnonzero(bits)
            if not any(t != tokenizer.eos_token for t in others.tolist()):
                return "it admits only the empty answer"
            if matcher.is_accepting():
                return "it admits the empty answer (no JSON text or call is empty)"
            return None
    reason = matcher.get_error() or str(matcher.stop_reason())
    return f"it admits no answer for this model's tokenizer ({reason.splitlines()[0]})"


def check_grammar(grammar: str, tokenizer, param: str) -> None:
    """Refuse a grammar that cannot start an answer for ``tokenizer`` (``grammar_tokenizer``): llguidance fails on
    its first mask, or it admits only the empty answer (no JSON text is empty). Cached per (grammar, tokenizer).

    Raises:
        GrammarError: naming ``param``, the request field the grammar comes from.
    """
    problem = _start_problem(grammar, tokenizer)
    if problem is not None:
        raise GrammarError(f"'{param}' cannot be enforced: {problem}", param)


def answer_matches(grammar: str, tokenizer, token_ids: list[int]) -> bool:
    """Whether the answer ``token_ids`` (without its end-of-text id) is a complete sentence of ``grammar``: the
    check a finished constrained answer must pass before it is returned as ``finish_reason: "stop"``."""
    matcher = _lib().LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error() or not matcher.consume_tokens([int(t) for t in token_ids]):
        return False
    return not matcher.is_error() and (matcher.is_accepting() or matcher.is_stopped())


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
        if self.is_forced(remaining):
            out[self._path[0]] = True
            return out
        n = min(vocab_size, self.vocab_size)
        out[:n] = torch.from_numpy(_bits(self.matcher)[:n])
        return out

    def is_forced(self, remaining: int | None) -> bool:
        """With ``remaining`` positions left, the closing path's next token is the only one allowed (``allowed``)."""
        return bool(self._path) and remaining is not None and remaining <= len(self._path)

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

    def commit_run(self, proposals: list[int], remaining: int) -> list[int]:
        """Advance by the longest prefix of ``proposals`` (tokens for consecutive positions from the leftmost
        open one, which was sampled under this grammar's mask) that the grammar accepts and the budget rule keeps
        (``settle``); the first is always kept, possibly swapped by ``settle``. Returns the kept tokens."""
        kept: list[int] = []
        for k, token in enumerate(proposals):
            if k > 0 and (self.matcher.is_stopped() or not self.accepts(token)):
                break
            settled = self.settle(token, remaining - k)
            if k > 0 and settled != token:
                break
            self.consume(settled)
            kept.append(settled)
        return kept

    def accepts(self, token_id: int) -> bool:
        """The grammar accepts ``token_id`` next (end-of-text: where the text may end); never an id past the
        tokenizer's vocabulary."""
        if token_id >= self.vocab_size or self.matcher.is_error():
            return False
        if token_id == self.eos_id:
            return self.matcher.is_accepting()
        return self.matcher.validate_tokens([int(token_id)]) == 1

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


@dataclass(slots=True)
class GrammarStep:
    """What a step needs for the rows of a batch that have a grammar (``grammar_step``).

    Attributes:
        cols: per row, the block's leftmost open (masked) column, where the grammar's mask applies (empty
            when no row has a grammar, as ``remaining``).
        remaining: per row, the answer positions left from that column on (it included).
        allowed: (B, L, V) bool token mask (rows without a grammar: everything), or None when no row has one.
        force: (B, L) bool, the leftmost open column of each row with a grammar: committed whatever the commit
            rule says, so every step commits at least one token there.
    """

    cols: list[int]
    remaining: list[int]
    allowed: torch.Tensor | None
    force: torch.Tensor | None


def grammar_step(constraints: list[Constraint | None], block: torch.Tensor, mask_id: int, left: list[int],
                 vocab_size: int, device: torch.device | str) -> GrammarStep:
    """The masks of one denoising step: ``block`` (B, L) the current block tokens, ``left`` per row the answer
    positions from the block's first column to the end of the answer."""
    if all(c is None for c in constraints):  # the common case costs nothing
        return GrammarStep([], [], None, None)
    cols = (block == mask_id).long().argmax(-1).tolist()  # (B,) first masked column
    remaining = [n - c for n, c in zip(left, cols, strict=True)]
    b, width = block.shape
    allowed = torch.ones((b, width, vocab_size), dtype=torch.bool)
    force = torch.zeros((b, width), dtype=torch.bool)
    for i, c in enumerate(constraints):
        if c is not None:
            allowed[i, cols[i]] = c.allowed(vocab_size, remaining[i])
            force[i, cols[i]] = True
    return GrammarStep(cols, remaining, allowed.to(device), force.to(device))


def constrain_commits(constraints: list[Constraint | None], step: GrammarStep, old: torch.Tensor,
                      new: torch.Tensor, committed: torch.Tensor, mask_id: int,
                      eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep, for each row with a grammar, the longest run of committed proposals from its leftmost open column
    that the grammar accepts (at least that column's grammar-masked token; the budget rule may swap it,
    ``Constraint.settle``); every other position of the row's block goes back to ``old``. A row whose grammar
    had already ended fills its open positions with end-of-text. The constraints advance by the kept tokens.

    Only a run without a gap is kept: a proposal after a still-open position cannot be checked by a left-to-right
    matcher without a search over the gap's fillings (Mündler et al., arXiv:2508.10111, decide whether a filling
    exists; DINGO, arXiv:2505.23061, finds the most likely one for a regular grammar); it is proposed again at the
    next step instead.

    Args:
        old / new: (B, L) the block before and after ``denoise_step``; committed: (B, L) bool, what it committed.

    Returns:
        (new block, committed) with the rows that have a grammar corrected (same devices as given).
    """
    if step.force is None:
        return new, committed
    device = new.device
    new, committed, old = new.cpu().clone(), committed.cpu().clone(), old.cpu()
    for i, c in enumerate(constraints):
        if c is None:
            continue
        col = step.cols[i]
        if c.stopped:  # complete: only end-of-text remains
            fill = old[i] == mask_id
            new[i] = torch.where(fill, torch.full_like(old[i], eos_id), old[i])
            committed[i] = fill
            continue
        proposals = []
        for j in range(col, new.shape[1]):
            if not bool(committed[i, j]):
                break
            proposals.append(int(new[i, j]))
        kept = c.commit_run(proposals, step.remaining[i])
        row_new, row_committed = old[i].clone(), torch.zeros_like(committed[i])
        row_new[col : col + len(kept)] = torch.tensor(kept, dtype=new.dtype)
        row_committed[col : col + len(kept)] = True
        new[i], committed[i] = row_new, row_committed
    return new.to(device), committed.to(device)
