"""celeris.text: incremental decoding, stop strings, canvas rendering (no HTTP)."""

from __future__ import annotations

import random

import pytest

from celeris.text import MASK_PLACEHOLDER, IncrementalText, partial_stop_len, render_canvas


def byte_decode(ids: list[int]) -> str:
    """A byte-level 'tokenizer': one token per byte, undecodable bytes become U+FFFD (as tokenizers does)."""
    return bytes(ids).decode("utf-8", errors="replace")


def reference(text: str, stops: list[str]) -> str:
    """The non-streamed answer: cut before the earliest stop string (LLM.finish)."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(cuts)] if cuts else text


def stream(ids: list[int], stops: list[str], rng: random.Random) -> tuple[list[str], IncrementalText]:
    inc = IncrementalText(byte_decode, stops)
    deltas, pos = [], 0
    while pos < len(ids):
        size = rng.randint(0, 4)
        piece = ids[pos : pos + size]
        pos += size
        deltas.append(inc.push(piece, final=pos >= len(ids)))
        if inc.done:
            break
    if not inc.done:
        deltas.append(inc.push([], final=True))
    return deltas, inc


def test_partial_stop_len():
    assert partial_stop_len("hello wor", ["world"]) == 3
    assert partial_stop_len("hello", ["world"]) == 0
    assert partial_stop_len("abc", ["abcd", "c"]) == 3
    assert partial_stop_len("x", ["x"]) == 0  # a whole stop string is an occurrence, not a prefix


@pytest.mark.parametrize("seed", range(40))
def test_deltas_concatenate_to_the_full_text_and_never_split_characters(seed):
    rng = random.Random(seed)
    alphabet = ["a", "b", " ", "\n", "é", "ü", "→", "語", "🙂", "def", "return"]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    stops = rng.choice([[], ["→"], ["re", "語🙂"], ["b a", "🙂"], ["aaaa"]])
    ids = list(text.encode())
    deltas, inc = stream(ids, stops, rng)
    assert "".join(deltas) == reference(text, stops) == inc.text
    for d in deltas:
        assert "\ufffd" not in d  # valid UTF-8 in, no replacement characters out
        assert not any(s in d for s in stops)
    assert inc.stopped == any(s in text for s in stops)


def test_multibyte_character_is_held_until_complete():
    inc = IncrementalText(byte_decode, [])
    euro = list("€".encode())  # 3 bytes
    assert inc.push([ord("a")] + euro[:1]) == "a"
    assert inc.push(euro[1:2]) == ""
    assert inc.push(euro[2:]) == "€"
    assert inc.push([], final=True) == ""
    assert inc.text == "a€" and inc.num_tokens() == 4


def test_invalid_bytes_are_flushed_at_the_end():
    inc = IncrementalText(byte_decode, [])
    assert inc.push([ord("x"), 0xE2]) == "x"
    assert inc.push([], final=True) == "\ufffd"


def test_stop_string_tail_is_held_back_then_released():
    inc = IncrementalText(byte_decode, ["world"])
    assert inc.push(list(b"hello wor")) == "hello "
    assert inc.push(list(b"m")) == "worm"
    assert not inc.stopped
    assert inc.push(list(b" world!")) == " "
    assert inc.stopped and inc.done and inc.text == "hello worm "
    assert inc.num_tokens() == len("hello worm ")


def test_an_earlier_stop_that_may_still_complete_wins():
    # "c" is complete but "abcd" could still start at 0: wait, as the non-streamed cut would.
    inc = IncrementalText(byte_decode, ["abcd", "c"])
    assert inc.push(list(b"abc")) == ""
    assert inc.push(list(b"d")) == ""
    assert inc.stopped and inc.text == ""
    inc = IncrementalText(byte_decode, ["abcd", "c"])
    inc.push(list(b"abc"))
    assert inc.push(list(b"x")) == "ab" and inc.stopped


def test_render_canvas_shows_masks_and_cuts_at_end_of_text():
    mask, eos = 1, 0

    def decode(ids):  # special tokens are dropped, as Tokenizer.decode does
        return byte_decode([i for i in ids if i not in (mask, eos)])

    ids = [ord("a"), mask, ord("b"), mask]
    assert render_canvas(decode, ids, mask, eos) == f"a{MASK_PLACEHOLDER}b{MASK_PLACEHOLDER}"
    assert render_canvas(decode, [ord("a"), eos, ord("z")], mask, eos) == "a"
    # end-of-text with masks before it may still move: keep showing the whole canvas
    assert render_canvas(decode, [mask, eos, ord("z")], mask, eos) == f"{MASK_PLACEHOLDER}z"
