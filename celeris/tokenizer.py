"""Thin wrapper on the ``tokenizers`` library: special ids, decoding, chat template.

Reads the Hugging Face tokenizer files of a checkpoint folder: ``tokenizer.json``,
``tokenizer_config.json`` (special tokens as strings or ``{"content": ...}``
dicts, and a Jinja ``chat_template``) and, where present, ``chat_template.jinja``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from celeris.chat_template import check_template_kwargs, compile_chat_template, render_chat_template

# The special tokens the engine needs, with the names Celeris checkpoints give them. A
# published folder may name them differently (tokenizer_config.json) or leave a name
# out and give only the id (config.json, e.g. LLaDA's mask_token_id).
SPECIAL_TOKENS = {"eos": "<|endoftext|>", "mask": "<|mask|>", "pad": "<|pad|>"}

# End-of-turn tokens of published chat formats (LLaDA / Llama 3, Dream / Qwen, Phi, Gemma, and LLaDA2.0 / Ling's
# <|role_end|>, which closes every turn of its chat template): where the tokenizer has one of these as a special
# token, generation ends at it as at end-of-text.
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|eom_id|>", "<|end_of_turn|>",
               "<|role_end|>")

# A base code model has no trained chat format; this template renders a
# conversation as Python comments and leaves the answer to be written as code.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% for line in message['content'].split('\\n') %}# {{ message['role'] }}: {{ line }}\n{% endfor %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


def write_tokenizer_config(folder: str | Path) -> None:
    """Write ``tokenizer_config.json`` (special tokens, chat template) beside ``tokenizer.json``."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
        "pad_token": "<|pad|>",
        "chat_template": CHAT_TEMPLATE,
    }
    Path(folder, "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def token_content(value: object) -> str | None:
    """A special-token entry of tokenizer_config.json: ``"<|x|>"`` or ``{"content": "<|x|>", ...}``; else None."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def read_json(path: Path) -> dict:
    """A JSON object from ``path``, or {} when the file does not exist."""
    return json.loads(path.read_text()) if path.is_file() else {}


def model_config_ids(folder: str | Path, raw: dict | None = None) -> dict[str, int]:
    """``{"eos": id, ...}`` from ``*_token_id`` of the folder's config.json (or the dict ``raw``) where given;
    a list of end-of-text ids gives its first."""
    raw = read_json(Path(folder) / "config.json") if raw is None else raw
    ids = {}
    for name in SPECIAL_TOKENS:
        value = raw.get(f"{name}_token_id")
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and not isinstance(value, bool):
            ids[name] = value
    return ids


def tokenizer_file_ids(folder: str | Path) -> dict[str, int]:
    """Ids of the special tokens that tokenizer_config.json names and tokenizer.json knows: ``{"eos": id, ...}``."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        return {}
    cfg = read_json(folder / "tokenizer_config.json")
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    ids = {}
    for name in SPECIAL_TOKENS:
        token = token_content(cfg.get(f"{name}_token"))
        idx = tok.token_to_id(token) if token is not None else None
        if idx is not None:
            ids[name] = idx
    return ids


def special_token_ids(raw: dict, folder: str | Path) -> dict[str, int]:
    """``{mask,eos,pad}_token_id`` for a model config: from its ``config.json`` dict ``raw``, then from the
    tokenizer files in ``folder``; a missing pad id falls back to the end-of-text id.

    Raises:
        ValueError: no mask or end-of-text id in either place.
    """
    folder = Path(folder)
    ids = model_config_ids(folder, raw)
    if len(ids) < len(SPECIAL_TOKENS):
        ids = tokenizer_file_ids(folder) | ids
    if "pad" not in ids and "eos" in ids:
        ids["pad"] = ids["eos"]
    for name in ("mask", "eos"):
        if name not in ids:
            raise ValueError(
                f"no {name}_token_id in {folder / 'config.json'} and no {name}_token in tokenizer_config.json"
            )
    return {f"{n}_token_id": v for n, v in ids.items()}


def read_chat_template(folder: Path, cfg: dict) -> str | None:
    """The Jinja chat template: ``chat_template.jinja`` if present, else tokenizer_config's ``chat_template``
    (a string, or a list of ``{"name", "template"}`` from which "default" is taken)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def read_chat_template_file(source: str | Path) -> str:
    """A chat template to replace the one a checkpoint ships (``--chat-template``, as vLLM's): the text of the
    Jinja file ``source``, or ``source`` itself when it is no file and reads as a one-line template (holds
    ``{{`` or ``{%``).

    Raises:
        ValueError: no such file (or one that is not UTF-8 text), or a template Jinja cannot parse (its line).
    """
    path = Path(source)
    if path.is_file():
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"chat template file '{source}' could not be read: {exc}") from None
    elif "{{" in str(source) or "{%" in str(source):
        template = str(source)
    else:
        raise ValueError(f"chat template file '{source}' does not exist")
    import jinja2

    try:
        compile_chat_template(template)  # the environment it will render in (celeris.chat_template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template '{source}' is not a valid Jinja template (line {exc.lineno}: "
                         f"{exc.message})") from None
    return template


class Tokenizer:
    """Byte-level BPE tokenizer of a checkpoint folder (or of a ``tokenizer.json`` file, with the
    ``tokenizer_config.json`` and ``chat_template.jinja`` beside it).

    Attributes:
        eos_token_id / mask_token_id / pad_token_id: special ids read from the
            tokenizer files (never literals). A token that tokenizer_config.json
            does not name comes from ``special_ids`` (default: the folder's
            config.json ``*_token_id``), then from the Celeris token name; a
            missing pad falls back to the end-of-text id (LLaDA and Dream pad
            with it).
        chat_template: Jinja template string, or None.
        bos_token_id: the id of tokenizer_config.json's ``bos_token``, or None.
        add_bos_token / add_eos_token: tokenizer_config.json's flags (default False): ``encode`` starts the
            text with the beginning-of-text id and ends it with the end-of-text id, and ``encode_chat`` starts
            with the beginning-of-text id, each once (not again where the text or template already writes it),
            as llama.cpp's ``add_special`` (a GGUF's ``tokenizer.ggml.add_bos_token``). What a ``tokenizer.json``
            post-processor adds (Hugging Face's way) goes around a plain ``encode`` once, and not around a chat
            prompt, whose template writes its own tokens (as ``apply_chat_template`` tokenizes).
        special_tokens: special-token strings of tokenizer_config.json
            (``bos_token``, ``eos_token``, ...), passed to the chat template.
    """

    def __init__(self, folder: str | Path, special_ids: dict[str, int] | None = None) -> None:
        path = Path(folder)
        folder = path.parent if path.is_file() else path
        tokenizer_file = str(path if path.is_file() else folder / "tokenizer.json")
        self._tok = HFTokenizer.from_file(tokenizer_file)
        cfg = read_json(folder / "tokenizer_config.json")
        self.chat_template: str | None = read_chat_template(folder, cfg)
        keys = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
        self.special_tokens = {k: token_content(cfg.get(k)) for k in keys if token_content(cfg.get(k)) is not None}
        fallback = model_config_ids(folder) if special_ids is None else special_ids
        self.eos_token_id = self._special_id("eos", fallback)
        self.mask_token_id = self._special_id("mask", fallback)
        self.pad_token_id = self._special_id("pad", fallback, last_resort=self.eos_token_id)
        self.vocab_size = self._tok.get_vocab_size()
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = self._tok.token_to_id(bos) if bos is not None else None
        self.add_bos_token = cfg.get("add_bos_token") is True and self.bos_token_id is not None
        self.add_eos_token = cfg.get("add_eos_token") is True
        # what the post-processor adds to a plain text (once per text, never per piece nor to a chat prompt)
        self._prefix_ids, self._suffix_ids = self._post_processor_ids()
        # A second instance that encodes special-token strings as plain text (so the shared one is never toggled).
        self._text_tok = HFTokenizer.from_file(tokenizer_file)  # the same file again: faster than to_str + from_str
        self._text_tok.encode_special_tokens = True
        reserved = {self.mask_token_id} | ({self.pad_token_id} - {self.eos_token_id})
        # The mask and pad strings: reserved ids that user text must never produce (pad only when it is not also
        # end-of-text, which LLaDA and Dream pad with and which a hand-written prompt may use).
        self.reserved_tokens: list[str] = sorted({t for t in map(self._tok.id_to_token, reserved) if t}, key=len,
                                                 reverse=True)
        added = self._tok.get_added_tokens_decoder().values()
        self.all_special_tokens: list[str] = sorted({a.content for a in added if a.special} | set(self.reserved_tokens),
                                                    key=len, reverse=True)

    def _special_id(self, name: str, fallback: dict[str, int], last_resort: int | None = None) -> int:
        """The id of the tokenizer_config token, else ``fallback[name]``, else the Celeris token name's id."""
        token = self.special_tokens.get(f"{name}_token")
        if token is not None:
            return self._id(token)
        if name in fallback:
            return fallback[name]
        if last_resort is not None and self._tok.token_to_id(SPECIAL_TOKENS[name]) is None:
            return last_resort
        return self._id(SPECIAL_TOKENS[name])

    def _id(self, token: str) -> int:
        idx = self._tok.token_to_id(token)
        if idx is None:
            raise ValueError(f"special token {token!r} is not in the tokenizer vocabulary")
        return idx

    def end_token_ids(self, folder: str | Path, generation_config: dict | None = None) -> list[int]:
        """Every id that ends generation: the end-of-text id, each ``eos_token_id`` (an int or a list) of the
        folder's config.json and of ``generation_config`` (default: its generation_config.json), and the
        tokenizer's end-of-turn special tokens (``END_OF_TURN``, e.g. LLaDA's ``<|eot_id|>``, Dream's
        ``<|im_end|>``). Ids outside the vocabulary are left out."""
        folder = Path(folder)
        gen = read_json(folder / "generation_config.json") if generation_config is None else generation_config
        ids = [self.eos_token_id]
        for source in (read_json(folder / "config.json"), gen):
            value = source.get("eos_token_id")
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, int) and not isinstance(v, bool):
                    ids.append(v)
        declared = set(ids)  # a pad id that a config also declares an end id (Qwen chat folders: <|endoftext|>) ends
        special = {a.content for a in self._tok.get_added_tokens_decoder().values() if a.special}
        ids += [self._tok.token_to_id(t) for t in END_OF_TURN if t in special]
        reserved = {self.mask_token_id} | ({self.pad_token_id} - declared)
        return sorted({i for i in ids if 0 <= i < self.vocab_size and i not in reserved})

    def split_stop(self, stop: list[str]) -> tuple[list[str], list[int]]:
        """Stop strings -> (stop strings, stop token ids): a string that is exactly a special token (e.g.
        ``"<|im_end|>"``) becomes that token's id, since special tokens are not in the decoded text."""
        special = {a.content: i for i, a in self._tok.get_added_tokens_decoder().items() if a.special}
        return [s for s in stop if s not in special], [special[s] for s in stop if s in special]

    def encode(self, text: str, as_text: Iterable[str] | None = None, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids. Special tokens written in ``text`` keep their ids (a hand-written chat prompt
        works, as in vLLM), except the strings in ``as_text`` (default: ``reserved_tokens``, the mask and pad
        tokens), which are encoded as the plain text they are: user text never becomes a reserved id. With
        ``add_special_tokens`` the ids start with the beginning-of-text id where ``add_bos_token`` says so and
        end with the end-of-text id where ``add_eos_token`` does (False for text that continues other text,
        such as a fill-in suffix)."""
        ids = self._encode_text(text, as_text)
        if add_special_tokens:
            ids = self._with_bos([*self._prefix_ids, *ids, *self._suffix_ids])
            if self.add_eos_token and ids[-1:] != [self.eos_token_id]:
                ids = [*ids, self.eos_token_id]
        return ids

    def _with_bos(self, ids: list[int]) -> list[int]:
        """``ids`` starting with the beginning-of-text id where ``add_bos_token`` asks for it (once)."""
        if self.add_bos_token and ids[:1] != [self.bos_token_id]:
            return [self.bos_token_id, *ids]
        return ids

    def _encode_text(self, text: str, as_text: Iterable[str] | None) -> list[int]:
        """``encode`` without the added tokens (neither ``add_bos_token``'s nor the post-processor's)."""
        literal = [t for t in (self.reserved_tokens if as_text is None else as_text) if t]
        if not literal or not any(t in text for t in literal):
            return self._tok.encode(text, add_special_tokens=False).ids
        pattern = "(" + "|".join(re.escape(t) for t in sorted(literal, key=len, reverse=True)) + ")"
        ids: list[int] = []
        for i, piece in enumerate(re.split(pattern, text)):  # odd pieces are the literal strings
            if piece:
                ids += (self._text_tok if i % 2 else self._tok).encode(piece, add_special_tokens=False).ids
        return ids

    def _post_processor_ids(self) -> tuple[list[int], list[int]]:
        """The ids ``tokenizer.json``'s post-processor puts before and after one text (Llama 3's
        ``<|begin_of_text|>``), found by encoding a probe with and without them; ([], []) without one."""
        plain, full = (self._tok.encode("a", add_special_tokens=flag).ids for flag in (False, True))
        for k in range(len(full) - len(plain) + 1):
            if full[k:k + len(plain)] == plain:
                return full[:k], full[k + len(plain):]
        return [], []

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **template_kwargs: object) -> list[int]:
        """Render ``messages`` with the chat template and encode the result; the special tokens the template
        writes (role markers, end-of-turn) keep their ids, while every special-token string that comes from the
        caller is encoded as plain text, whatever field carries it: message contents, names and tool calls (names,
        arguments), tool definitions (names, descriptions, parameter schemas, keys included) and the extra
        template variables ``template_kwargs`` (a user cannot forge a role marker or a mask).

        Each such string is swapped for a character of its own, absent from all of those strings and from the
        template, before rendering (``_sentinels``), and encoded as text where that character lands; everything
        else is encoded without tokenizer.json's post-processor tokens, as ``apply_chat_template`` does. ``tools``
        (OpenAI tool definitions) go to a template that reads them (``apply_chat_template``), as do
        ``template_kwargs``.

        Raises:
            ValueError: a ``template_kwargs`` name that is one of the renderer's own (``apply_chat_template``).
            jinja2.TemplateError: the template refuses the conversation.
        """
        swap, back = self._sentinels([messages, tools, template_kwargs])
        rendered = self.apply_chat_template(swap(messages), add_generation_prompt, swap(tools), **swap(template_kwargs))
        ids: list[int] = []
        for piece in re.split("([" + "".join(back) + "])", rendered) if back else [rendered]:
            if piece in back:
                ids += self._text_tok.encode(back[piece], add_special_tokens=False).ids
            elif piece:
                ids += self._encode_text(piece, None)
        return self._with_bos(ids)

    def _sentinels(self, values: object) -> tuple[Callable[[object], object], dict[str, str]]:
        """(swap, back): ``swap(value)`` copies ``value`` (strings, lists, tuples and dicts, keys included) with
        every special-token string replaced by its own character; ``back`` maps each character to its token.

        The characters are CJK ideographs of Extension B (U+20000 on): printable, without case and kept as they
        are by ``tojson`` and ``repr``, so a template that prints a value through a filter still shows the
        character (a private-use character would come out of ``repr`` as an escape). The first run of them that
        neither ``values`` nor the template contains is taken."""
        tokens = self.all_special_tokens
        if not tokens:
            return (lambda value: value), {}
        used = set("".join(_strings(values)) + (self.chat_template or ""))
        base = next(c for c in range(0x20000, 0x2A6DF - len(tokens))
                    if not any(chr(c + k) in used for k in range(len(tokens))))
        sentinel = {tok: chr(base + k) for k, tok in enumerate(tokens)}
        pattern = re.compile("|".join(re.escape(t) for t in tokens))  # longest first (all_special_tokens' order)
        return partial(_replace_strings, lambda s: pattern.sub(lambda m: sentinel[m.group(0)], s)), \
            {c: tok for tok, c in sentinel.items()}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text; special tokens are dropped unless ``skip_special_tokens`` is False."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_texts(self, count: int) -> list[str]:
        """The text of each id below ``count`` decoded alone, special tokens kept (DRY's sequence breakers are
        matched on them: ``celeris.sampling.dry.breaker_ids``)."""
        return self._tok.decode_batch([[i] for i in range(count)], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **template_kwargs: object) -> str:
        """Render ``messages`` ([{"role", "content", ...}, ...]) with the checkpoint's Jinja chat template as Hugging
        Face's ``apply_chat_template`` does (``celeris.chat_template``); ``tools`` (OpenAI tool definitions, or
        None), the special tokens of tokenizer_config.json and ``template_kwargs`` (e.g. Qwen3's
        ``enable_thinking``, which SDAR's template reads) are passed to it. Special-token strings are left as they
        are: ``encode_chat`` is what keeps the caller's strings text.

        Raises:
            ValueError: a ``template_kwargs`` name that is one of the renderer's own (``messages``, ``tools``,
                ``add_generation_prompt``, ``bos_token``, ...).
            jinja2.TemplateError: the template is invalid or refuses the conversation."""
        if not self.chat_template:
            check_template_kwargs(template_kwargs)
            return "\n".join(m["content"] for m in messages) + "\n"
        return render_chat_template(self.chat_template, messages, add_generation_prompt, tools, self.special_tokens,
                                    template_kwargs)


def _strings(value: object) -> Iterable[str]:
    """Every string inside ``value`` (lists, tuples and dicts, keys included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _replace_strings(replace: Callable[[str], str], value: object) -> object:
    """``value`` with ``replace`` applied to every string inside it (lists and tuples become lists)."""
    if isinstance(value, str):
        return replace(value)
    if isinstance(value, dict):
        return {_replace_strings(replace, k): _replace_strings(replace, v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_replace_strings(replace, v) for v in value]
    return value
