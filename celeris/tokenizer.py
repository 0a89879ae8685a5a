"""Thin wrapper on the ``tokenizers`` library: special ids, decoding, chat template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

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


class Tokenizer:
    """Byte-level BPE tokenizer of a checkpoint folder.

    Attributes:
        eos_token_id / mask_token_id / pad_token_id: special ids read from the
            tokenizer files (never literals).
        chat_template: Jinja template string, or None.
    """

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        self._tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        self.eos_token_id = self._id(cfg.get("eos_token", "<|endoftext|>"))
        self.mask_token_id = self._id(cfg.get("mask_token", "<|mask|>"))
        self.pad_token_id = self._id(cfg.get("pad_token", "<|pad|>"))
        self.vocab_size = self._tok.get_vocab_size()

    def _id(self, token: str) -> int:
        idx = self._tok.token_to_id(token)
        if idx is None:
            raise ValueError(f"special token {token!r} is not in the tokenizer vocabulary")
        return idx

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text; special tokens are dropped."""
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{"role", "content"}]) with the checkpoint's Jinja chat template."""
        if not self.chat_template:
            return "\n".join(m["content"] for m in messages) + "\n"
        import jinja2

        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt
        )
