"""The Python standard library as a training corpus, and its tokenizer.

``build_stdlib_corpus`` collects every ``.py`` file of the running interpreter's
standard library (``sysconfig.get_paths()["stdlib"]``, without site-packages),
in sorted path order, and holds out a fixed 5% of files chosen by a hash of the
relative path, so anyone with the same Python version rebuilds the same split.
It then trains a byte-level BPE with the ``tokenizers`` library on the training
split and writes both splits as flat uint16 token-id files, documents joined by
the end-of-text token.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, MASK_TOKEN, PAD_TOKEN]

HELD_OUT_PERCENT = 5
MAX_FILE_BYTES = 1_000_000  # skip generated giants (e.g. huge test data tables)


def is_held_out(rel_path: str) -> bool:
    """A file is held out when sha256(relative path) mod 100 < 5: a fixed 5% split."""
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELD_OUT_PERCENT


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library, excluding site-/dist-packages."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_source(path: Path) -> str | None:
    """File text, or None for files that are too large or not UTF-8 (a few test fixtures)."""
    data = path.read_bytes()
    if len(data) > MAX_FILE_BYTES:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def train_tokenizer(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenisation) with the Celeris special tokens first.

    Ids: ``<|endoftext|>`` = 0, ``<|mask|>`` = 1, ``<|pad|>`` = 2.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_stdlib_corpus(out_dir: str | Path, vocab_size: int = 4096, root: Path | None = None) -> dict:
    """Write ``tokenizer.json``, ``train.bin``, ``val.bin`` (uint16) and ``manifest.json`` to ``out_dir``.

    Returns the manifest: Python version, file counts per split, bytes and tokens.
    Raises ValueError when no source files are found.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stdlib_root = Path(root or sysconfig.get_paths()["stdlib"])
    splits: dict[str, list[str]] = {"train": [], "val": []}
    docs: dict[str, list[str]] = {"train": [], "val": []}
    for path in stdlib_files(stdlib_root):
        text = read_source(path)
        if not text or not text.strip():
            continue
        rel = path.relative_to(stdlib_root).as_posix()
        split = "val" if is_held_out(rel) else "train"
        splits[split].append(rel)
        docs[split].append(text)
    if not docs["train"]:
        raise ValueError(f"no Python source files found under {stdlib_root}")
    tok = train_tokenizer(iter(docs["train"]), vocab_size)
    tok.save(str(out / "tokenizer.json"))
    eos_id = tok.token_to_id(EOS_TOKEN)
    manifest: dict = {
        "python": sys.version.split()[0],
        "stdlib_root": str(stdlib_root),
        "held_out_rule": f"sha256(relative path) mod 100 < {HELD_OUT_PERCENT}",
        "vocab_size": tok.get_vocab_size(),
    }
    for split, texts in docs.items():
        ids: list[int] = []
        for enc in tok.encode_batch(texts):
            ids.extend(enc.ids)
            ids.append(eos_id)
        np.asarray(ids, dtype=np.uint16).tofile(out / f"{split}.bin")
        manifest[split] = {
            "files": len(texts),
            "bytes": sum(len(t.encode()) for t in texts),
            "tokens": len(ids),
        }
    (out / "files.json").write_text(json.dumps(splits, indent=0) + "\n")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_tokens(path: str | Path) -> np.ndarray:
    """Memory-map a uint16 token file written by ``build_stdlib_corpus``."""
    return np.memmap(path, dtype=np.uint16, mode="r")
