"""The stdlib corpus: a deterministic 5% held-out split, file filtering, token files that round-trip."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from celeris.train.data import (
    EOS_TOKEN,
    SPECIAL_TOKENS,
    build_stdlib_corpus,
    is_held_out,
    load_tokens,
    stdlib_files,
    train_tokenizer,
)
from tests.conftest import PYTHON_SNIPPETS, write_fake_stdlib


def test_is_held_out_deterministic_and_about_five_percent():
    paths = [f"pkg{i % 37}/module_{i}.py" for i in range(4000)]
    first = [is_held_out(p) for p in paths]
    assert first == [is_held_out(p) for p in paths]
    fraction = sum(first) / len(paths)
    assert 0.04 < fraction < 0.06
    # a pure function of the relative path: the same answer in any order
    assert [is_held_out(p) for p in reversed(paths)] == first[::-1]


def test_stdlib_files_filters_and_sorts(tmp_path):
    write_fake_stdlib(tmp_path)
    rel = [p.relative_to(tmp_path).as_posix() for p in stdlib_files(tmp_path)]
    assert rel == sorted(rel)
    assert "site-packages/third_party.py" not in rel
    assert "__pycache__/cached.py" not in rel
    assert "notes.txt" not in rel
    assert {"mod0.py", "pkg/inner.py"} <= set(rel)


def test_tokenizer_special_ids_first():
    tok = train_tokenizer(iter(PYTHON_SNIPPETS), vocab_size=300)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert 259 <= tok.get_vocab_size() <= 300
    text = "def f(x):\n    return x + 1  # é\n"
    assert tok.decode(tok.encode(text).ids) == text  # byte-level: lossless


def test_build_corpus_outputs(corpus_dir):
    for name in ("tokenizer.json", "train.bin", "val.bin", "manifest.json", "files.json"):
        assert (corpus_dir / name).is_file(), name
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    files = json.loads((corpus_dir / "files.json").read_text())
    stdlib_root = corpus_dir.parent / "fake_stdlib"
    kept = [p.relative_to(stdlib_root).as_posix() for p in stdlib_files(stdlib_root)]
    kept = [r for r in kept if r not in ("latin1.py", "pkg/empty.py")]  # not UTF-8; blank
    assert files["val"] == [r for r in kept if is_held_out(r)] and files["val"]
    assert files["train"] == [r for r in kept if not is_held_out(r)]
    assert manifest["train"]["files"] == len(files["train"])
    assert manifest["val"]["files"] == len(files["val"])
    assert manifest["held_out_rule"].startswith("sha256")
    for split in ("train", "val"):
        tokens = load_tokens(corpus_dir / f"{split}.bin")
        assert tokens.dtype == np.uint16
        assert len(tokens) == manifest[split]["tokens"]
        assert (corpus_dir / f"{split}.bin").stat().st_size == 2 * len(tokens)


def test_token_files_decode_to_the_sources(corpus_dir):
    tok = Tokenizer.from_file(str(corpus_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS_TOKEN)
    files = json.loads((corpus_dir / "files.json").read_text())
    root = corpus_dir.parent / "fake_stdlib"
    for split in ("train", "val"):
        ids = load_tokens(corpus_dir / f"{split}.bin").tolist()
        assert ids[-1] == eos
        docs, current = [], []
        for i in ids:
            if i == eos:
                docs.append(current)
                current = []
            else:
                current.append(i)
        assert len(docs) == len(files[split])
        for rel, doc in zip(files[split], docs, strict=True):
            assert tok.decode(doc) == (root / rel).read_text()


def test_build_corpus_without_sources_fails(tmp_path):
    (tmp_path / "empty_root").mkdir()
    with pytest.raises(ValueError, match="no Python source files"):
        build_stdlib_corpus(tmp_path / "out", vocab_size=300, root=tmp_path / "empty_root")
