"""The tokenizer a GGUF file carries, rebuilt with the ``tokenizers`` library so that it splits text as llama.cpp does.

A GGUF file (llama.cpp's format) stores its tokenizer as metadata: ``tokenizer.ggml.model`` (the algorithm;
"gpt2" is byte-level BPE), ``tokenizer.ggml.tokens`` (the vocabulary, index = id), ``tokenizer.ggml.merges``
(BPE merges ``"a b"``, index = rank), ``tokenizer.ggml.token_type`` (normal, control, user-defined, ...) and
``tokenizer.ggml.pre``, the name of the pre-tokenizer: the regular expressions that cut text into the pieces BPE
works on. The names and their expressions follow llama.cpp's table (``src/llama-vocab.cpp``,
``llama_vocab::impl::load`` for the names and ``llm_tokenizer_bpe`` for the expressions, ggml-org/llama.cpp):
each expression splits every piece the previous one left into its matches and the text between them, which is
``tokenizers``' ``Split(..., behavior="isolated")`` applied in sequence, followed by GPT-2's byte-to-character map
(``ByteLevel`` without its own regex).

Control tokens (``<|im_start|>``...) become special added tokens and user-defined tokens plain added tokens, so
both are cut out of the text before pre-tokenization as llama.cpp's ``tokenizer_st_partition`` does (a control
token only where special tokens are parsed: ``tokenizers``' ``encode_special_tokens`` False). Beginning- and
end-of-text tokens are not added by ``tokenizer.json``: ``tokenizer_config_from_gguf`` records
``add_bos_token`` / ``add_eos_token``, which ``celeris.tokenizer.Tokenizer`` applies.

Not reproduced: llama.cpp's ``clean_spaces`` detokenization option (spaces before punctuation are dropped when
it decodes; here decoding gives the exact bytes), its renaming of end-of-turn-looking tokens typed "normal" to
control, and merges whose parts or result are not in the vocabulary (left out; llama.cpp would still apply them
and fall back to byte tokens).
"""

from __future__ import annotations

import json
import numbers
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers


class GGUFTokenizerError(ValueError):
    """The GGUF metadata holds no tokenizer Celeris can rebuild (the message names the key or value)."""


# llama.cpp's token types (gguf.TokenType, llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's pre-tokenizer expressions, per LLAMA_VOCAB_PRE_TYPE_* (src/llama-vocab.cpp, llm_tokenizer_bpe),
# applied in order; written as there (the "adapted" forms llama.cpp uses, with (?:'[sS]|...) for (?i:'s|...)).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
          r"|\s+")
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)"
              r"|\s+")
BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]|\s+(?!\S)|\s+")
BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"

PRE_TYPE_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "llama3": (LLAMA3,),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"),
    "starcoder": (r"\p{N}", GPT2),  # also refact, command-r, smollm, codeshell, exaone, minerva, mellum2
    "gpt2": (GPT2,),  # also mpt, olmo, jais, trillion, granite-docling
    "qwen2": (QWEN2,),  # also stablelm2, hunyuan, solar-open, grok-2 (the same expression)
    "qwen35": (QWEN35,),
    "seed-coder": (SEED_CODER,),
    "bailingmoe": (BAILINGMOE,),
    "bloom": (BLOOM,),  # also poro, gpt3-finnish
    "viking": (BLOOM, r"\p{N}"),
}

# tokenizer.ggml.pre -> pre type (llama_vocab::impl::load). Names llama.cpp knows but Celeris does not list here
# (deepseek, tekken, gpt-4o, chatglm, kimi-k2, ...) are refused.
PRE_TYPES: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), "llama3"),
    "falcon": "falcon",
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
                    "starcoder"),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"), "gpt2"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
                     "grok-2"), "qwen2"),
    "qwen35": "qwen35",
    "seed-coder": "seed-coder",
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), "bailingmoe"),
    **dict.fromkeys(("bloom", "poro-chat", "gpt3-finnish"), "bloom"),
    "viking": "viking",
}

# Pre types whose BPE emits a piece that is itself a token without merging it (llama.cpp's ignore_merges), and
# those that add a beginning-of-text token unless tokenizer.ggml.add_bos_token says otherwise.
IGNORE_MERGES = frozenset({"llama3"})
ADDS_BOS = frozenset({"llama3"})

# The special-token ids a GGUF may name, keyed by tokenizer_config.json's names.
SPECIAL_ID_KEYS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                   "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id",
                   "sep_token": "tokenizer.ggml.seperator_token_id", "mask_token": "tokenizer.ggml.mask_token_id"}


def pre_type(fields: Mapping[str, Any]) -> str:
    """The llama.cpp pre type (a key of ``PRE_TYPE_REGEXES``) that ``tokenizer.ggml.pre`` names; a file without
    one gets "default" with a warning, as in llama.cpp.

    Raises:
        GGUFTokenizerError: a name not in ``PRE_TYPES``.
    """
    name = fields.get("tokenizer.ggml.pre")
    if name is None or name == "":
        warnings.warn("GGUF metadata has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer "
                      "(llama.cpp warns that generation quality will be degraded)", stacklevel=2)
        return "default"
    if name not in PRE_TYPES:
        raise GGUFTokenizerError(f"tokenizer.ggml.pre '{name}' is not a pre-tokenizer Celeris knows (known: "
                                 f"{', '.join(sorted(PRE_TYPES))}); pass --tokenizer PATH with the model's "
                                 "tokenizer.json")
    return PRE_TYPES[name]


def _listed(fields: Mapping[str, Any], key: str) -> list:
    """The array ``fields[key]`` as a list (a list or a numpy array may be given); [] when absent."""
    value = fields.get(key)
    return [] if value is None else list(value)


def _tokens(fields: Mapping[str, Any]) -> list[str]:
    """``tokenizer.ggml.tokens`` checked: present, not empty, no duplicates (empty strings renamed as llama.cpp)."""
    model = fields.get("tokenizer.ggml.model")
    tokens = _listed(fields, "tokenizer.ggml.tokens")
    if not model or not tokens:
        missing = [k for k, v in (("tokenizer.ggml.model", model), ("tokenizer.ggml.tokens", tokens)) if not v]
        raise GGUFTokenizerError(f"GGUF metadata has no tokenizer ({' and '.join(missing)} missing); pass "
                                 "--tokenizer PATH with the model's tokenizer.json")
    if model != "gpt2":
        kind = {"llama": "SentencePiece", "bert": "WordPiece", "t5": "Unigram"}.get(model, "unknown")
        raise GGUFTokenizerError(f"tokenizer.ggml.model '{model}' ({kind}) is not supported: Celeris rebuilds only "
                                 "'gpt2' (byte-level BPE) GGUF tokenizers; pass --tokenizer PATH with the model's "
                                 "tokenizer.json")
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token in seen:
            raise GGUFTokenizerError(f"tokenizer.ggml.tokens has '{token}' twice (ids {seen[token]} and {i})")
        seen[token] = i
    return tokens


def _merges(fields: Mapping[str, Any], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` as pairs in rank order, split at the first space after the first character (as
    llama.cpp does); merges whose parts or result the vocabulary lacks are left out."""
    merges = _listed(fields, "tokenizer.ggml.merges")
    if not merges:
        raise GGUFTokenizerError("GGUF metadata has tokenizer.ggml.tokens but no tokenizer.ggml.merges, which a "
                                 "'gpt2' (BPE) tokenizer needs")
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)
        if cut < 0:
            continue
        left, right = merge[:cut], merge[cut + 1:]
        if left in vocab and right in vocab and left + right in vocab:
            pairs.append((left, right))
    return pairs


def tokenizer_from_gguf(fields: Mapping[str, Any]) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` equal to llama.cpp's for a "gpt2" (byte-level BPE) GGUF tokenizer.

    Args:
        fields: the GGUF metadata as plain Python values keyed by GGUF key names (``tokenizer.ggml.tokens``: a
            list of str, ``tokenizer.ggml.token_type``: a list of int, ...).

    Returns:
        A tokenizer whose ids are the GGUF's token indices; ``encode(text).ids`` equals llama.cpp's
        ``llama_tokenize(text, add_special=False, parse_special=True)``; ``decode`` maps bytes back exactly.

    Raises:
        GGUFTokenizerError: no tokens (or no model name), a model other than "gpt2", no merges, a duplicate
            token, or a ``tokenizer.ggml.pre`` Celeris does not know, each named.
    """
    tokens = _tokens(fields)
    kind = pre_type(fields)
    vocab = {token: i for i, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=_merges(fields, vocab), ignore_merges=kind in IGNORE_MERGES,
                     fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TYPE_REGEXES[kind]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = [int(t) for t in _listed(fields, "tokenizer.ggml.token_type")]  # ints, or numpy's
    if types and len(types) < len(tokens):
        raise GGUFTokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    added = [AddedToken(tokens[i], special=t in (CONTROL, UNKNOWN), normalized=False)
             for i, t in enumerate(types[:len(tokens)]) if t in (CONTROL, UNKNOWN, USER_DEFINED)]
    tok.add_tokens(added)  # special or not as each AddedToken says; ids stay the vocabulary's
    return tok


def _special_tokens(fields: Mapping[str, Any]) -> dict[str, str]:
    """``{"bos_token": "<|im_start|>", ...}`` for each special-token id of the metadata inside the vocabulary."""
    tokens = _listed(fields, "tokenizer.ggml.tokens")
    named = {}
    for name, key in SPECIAL_ID_KEYS.items():
        idx = fields.get(key)
        if isinstance(idx, numbers.Integral) and not isinstance(idx, bool):  # an int or a numpy integer
            idx = int(idx)
            if 0 <= idx < len(tokens):
                named[name] = tokens[idx]
            else:
                warnings.warn(f"{key} = {idx} is outside the vocabulary of {len(tokens)} tokens; ignored",
                              stacklevel=3)
    return named


def tokenizer_config_from_gguf(fields: Mapping[str, Any]) -> dict:
    """The ``tokenizer_config.json`` of a GGUF's tokenizer, for ``celeris.tokenizer.Tokenizer``.

    Special tokens (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, and ``sep_token`` /
    ``mask_token`` where given) are the token strings of ``tokenizer.ggml.*_token_id``; ``add_bos_token`` /
    ``add_eos_token`` are ``tokenizer.ggml.add_bos_token`` / ``add_eos_token``, defaulting as in llama.cpp (a
    beginning-of-text token for the llama3 pre type, else none); ``chat_template`` is ``tokenizer.chat_template``.

    Raises:
        GGUFTokenizerError: as ``tokenizer_from_gguf`` for the pre-tokenizer, or a token to be added
            (``add_bos_token`` true) whose id the metadata does not give.
    """
    kind = pre_type(fields)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    config |= _special_tokens(fields)
    for which, default in (("bos", kind in ADDS_BOS), ("eos", False)):
        add = fields.get(f"tokenizer.ggml.add_{which}_token", default)
        if add and f"{which}_token" not in config:
            raise GGUFTokenizerError(f"tokenizer.ggml.add_{which}_token is true but the metadata gives no "
                                     f"{SPECIAL_ID_KEYS[f'{which}_token']} inside the vocabulary")
        config[f"add_{which}_token"] = bool(add)
    template = fields.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return config


def write_tokenizer_files(fields: Mapping[str, Any], folder: str | Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` of the GGUF's tokenizer into ``folder`` (which
    must exist), so that ``celeris.tokenizer.Tokenizer(folder)`` loads it.

    Raises:
        GGUFTokenizerError: as ``tokenizer_from_gguf`` and ``tokenizer_config_from_gguf``.
    """
    tok, config = tokenizer_from_gguf(fields), tokenizer_config_from_gguf(fields)
    tok.save(str(Path(folder) / "tokenizer.json"))
    Path(folder, "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
