"""Final answer tokens -> text: stop strings, streamed text that is never taken back, and the canvas view.

The engine's output stage, shared by the offline facade (``celeris.llm``: ``cut_at_stop``), the CLI's
``--show-denoise`` view (``render_canvas``) and the HTTP server's streams (``IncrementalText``); vLLM keeps the same
concern in ``v1/engine/detokenizer.py``, below its API servers.

Byte-level BPE decoding of a prefix of tokens is a prefix of the decoded text, except for an
unfinished multi-byte UTF-8 character at the end, which decodes to U+FFFD; ``IncrementalText``
holds such a tail back, and also any tail that could still become the start of a stop string, so the
concatenated deltas equal the non-streamed answer (``cut_at_stop``) for the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from celeris.structured.grammar import stops_apply

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an unfinished UTF-8 sequence
MASK_PLACEHOLDER = "\u2591"  # a still-masked position in stream_mode "denoise"


def find_stop(text: str, stops: list[str]) -> tuple[int, int] | None:
    """(start, end) of the earliest stop string in ``text`` (the longest one where several start there), or None."""
    hits = [(i, -len(s)) for s in stops if s and (i := text.find(s)) >= 0]
    if not hits:
        return None
    start, neg_len = min(hits)
    return start, start - neg_len


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string (0 if none)."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def tokens_within(decode: Callable[[list[int]], str], token_ids: list[int], num_chars: int) -> int:
    """The largest n with ``len(decode(token_ids[:n])) <= num_chars``: the tokens behind a text cut at a stop
    string (``cut_at_stop``; the decoded length of a prefix grows with it), by binary search."""
    lo, hi = 0, len(token_ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(decode(token_ids[:mid])) <= num_chars:
            lo = mid
        else:
            hi = mid - 1
    return lo


def cut_at_stop(decode: Callable[[list[int]], str], token_ids: list[int], stops: list[str],
                include_stop: bool = False) -> tuple[str, list[int], bool]:
    """The answer's text and tokens cut before its earliest stop string (after it with ``include_stop``), and
    whether one was found. The rule ``IncrementalText`` streams by."""
    text = decode(token_ids)
    match = find_stop(text, stops)
    if match is None:
        return text, token_ids, False
    text = text[: match[1] if include_stop else match[0]]
    return text, token_ids[: tokens_within(decode, token_ids, len(text))], True


class IncrementalText:
    """Turns final answer tokens, arriving in pieces, into text deltas that are never taken back.

    ``push`` decodes the whole final prefix (byte-level BPE decoding of a prefix is a prefix of the
    text, except for an unfinished multi-byte character, which decodes to U+FFFD and is held back)
    and returns the new text that is safe to send: text before the first stop string, minus trailing
    U+FFFD and any tail that could still become the start of one. With ``final=True`` everything left is flushed, with
    the same stop rule as ``cut_at_stop``: the answer ends before the earliest stop occurrence.

    Args:
        decode: token ids -> text.
        stop: stop strings (not returned, unless ``include_stop``: then the text ends with the one matched).
        grammar: the grammar the answer is decoded under (``SamplingParams.grammar``), if any: stop strings then
            end only free text (``celeris.structured.grammar.stops_apply``; while undecided, text is held).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str], include_stop: bool = False,
                 grammar: str | None = None) -> None:
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self.grammar = grammar
        self.token_ids: list[int] = []
        self.text = ""  # what has been handed out
        self.stopped = False  # a stop string ended the answer
        self.done = False

    def push(self, new_ids: list[int], final: bool = False) -> str:
        if self.done:
            return ""
        self.token_ids.extend(new_ids)
        if not new_ids and not final:
            return ""
        full = self.decode(self.token_ids)
        if not final:  # an unfinished multi-byte character decodes to U+FFFD: hold it back
            full = full.rstrip(REPLACEMENT_CHAR)
        stops = self.stop
        if stops and self.grammar is not None:  # under a grammar, stop strings end free text only
            applies = stops_apply(self.grammar, full)
            if applies is None and not final:
                return ""  # a call or text? decided by the next characters
            if applies is False:
                self.stop = stops = []
        match = find_stop(full, stops)
        hold = len(full) - partial_stop_len(full, stops)  # a stop string could still start here
        if match is not None and (final or match[0] <= hold):
            end, self.stopped = match[1] if self.include_stop else match[0], True
        else:
            end = len(full) if final else hold
        delta = full[len(self.text) : end] if end > len(self.text) else ""
        self.text += delta
        self.done = final or self.stopped
        return delta

    def num_tokens(self) -> int:
        """Answer tokens behind the returned text (all final tokens, or those before a stop string)."""
        return tokens_within(self.decode, self.token_ids, len(self.text)) if self.stopped else len(self.token_ids)


def render_canvas(decode: Callable[[list[int]], str], ids: list[int], mask_id: int, eos_id: int) -> str:
    """The answer canvas as text, each masked position shown as MASK_PLACEHOLDER; cut at end-of-text
    once everything before it is committed."""
    if eos_id in ids and mask_id not in ids[: ids.index(eos_id)]:
        ids = ids[: ids.index(eos_id)]
    pieces, run = [], []
    for tid in ids:
        if tid == mask_id:
            if run:
                pieces.append(decode(run))
                run = []
            pieces.append(MASK_PLACEHOLDER)
        else:
            run.append(tid)
    if run:
        pieces.append(decode(run))
    return "".join(pieces)
