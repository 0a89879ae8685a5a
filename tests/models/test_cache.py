"""The conversion cache (celeris.models.cache): atomic entries, keys, stale temporary folders, an unusable cache."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from celeris.models import cache


@pytest.fixture
def root(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("CELERIS_CACHE", str(folder))
    return folder


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    return path


def writer(calls: list):
    def write(folder):
        calls.append(folder)
        (folder / "model.safetensors").write_bytes(b"weights")
        return {"architecture": "llama"}
    return write


def test_entry_is_written_once_then_read(root, source):
    calls: list = []
    first = cache.cached_or_convert("gguf", source, writer(calls))
    second = cache.cached_or_convert("gguf", source, writer(calls))
    assert first == second and len(calls) == 1
    assert first.parent == root / "gguf" and first.name.startswith("model-")
    assert calls[0] != first and calls[0].name.startswith(".model-")  # written under a temporary name
    record = json.loads((first / cache.SOURCE_FILE).read_text())
    key = cache.source_key(source)
    assert record["size"] == key.size and record["mtime_ns"] == key.mtime_ns and record["architecture"] == "llama"
    assert [p.name for p in (root / "gguf").iterdir()] == [first.name]  # no temporary folder left


def test_a_changed_source_gets_a_new_entry(root, source):
    calls: list = []
    first = cache.cached_or_convert("gguf", source, writer(calls))
    source.write_bytes(source.read_bytes()[:-1] + b"!")  # same size, other header bytes
    os.utime(source, ns=(1, 1))
    second = cache.cached_or_convert("gguf", source, writer(calls))
    assert second != first and len(calls) == 2


def test_an_entry_whose_record_disagrees_is_not_read(root, source):
    folder = cache.cached_or_convert("gguf", source, writer([]))
    record = json.loads((folder / cache.SOURCE_FILE).read_text())
    (folder / cache.SOURCE_FILE).write_text(json.dumps({**record, "header_sha256": "0" * 64}))
    assert cache.read_entry("gguf", source) is None


def test_stale_temporary_folders_are_removed_live_ones_kept(root, source):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    kind = root / "gguf"
    stale = kind / f".model-abc.tmp-{dead_pid}-0000"
    live = kind / f".model-abc.tmp-{os.getppid()}-1111"  # the parent runs: its conversion may be under way
    for folder in (stale, live):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half")
    cache.cached_or_convert("gguf", source, writer([]))
    assert not stale.exists() and live.exists()


def test_a_failed_write_leaves_nothing(root, source):
    def fail(folder):
        (folder / "part").write_bytes(b"x")
        raise ValueError("bad file")

    with pytest.raises(ValueError, match="bad file"):
        cache.cached_or_convert("gguf", source, fail)
    assert list((root / "gguf").iterdir()) == []


def test_a_full_disk_is_reported_as_unavailable_and_cleaned(root, source):
    def full(folder):
        (folder / "part").write_bytes(b"x")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(cache.CacheUnavailableError, match="No space left on device"):
        cache.cached_or_convert("gguf", source, full)
    assert list((root / "gguf").iterdir()) == []


def test_a_cache_that_is_not_a_folder_is_unavailable(tmp_path, monkeypatch, source):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CELERIS_CACHE", str(blocker))
    with pytest.raises(cache.CacheUnavailableError, match="cannot write the cache folder"):
        cache.cached_or_convert("gguf", source, writer([]))


def test_list_and_clear(root, source):
    folder = cache.cached_or_convert("gguf", source, writer([]))
    entries = cache.list_entries()
    assert [(e["kind"], e["path"], e["source"]) for e in entries] == [("gguf", str(folder), "model.gguf")]
    assert entries[0]["bytes"] > len(b"weights")
    assert cache.clear() == 1
    assert cache.list_entries() == [] and not folder.exists()


def test_two_writers_of_one_entry_keep_the_first(root, source):
    """Two processes converting the same file at once (e.g. Ray workers): the second rename finds the entry."""
    key = cache.source_key(source)
    with cache.writing_entry("gguf", source, key) as slow:
        (slow / "model.safetensors").write_bytes(b"second")
        first = cache.cached_or_convert("gguf", source, writer([]))  # finishes while the other is still writing
    assert (first / "model.safetensors").read_bytes() == b"weights"
    assert [p.name for p in (root / "gguf").iterdir()] == [first.name]


def test_a_variant_entry_sits_beside_the_plain_one(root, source):
    plain = cache.cached_or_convert("gguf", source, writer([]))
    key = cache.source_key(source)
    with cache.writing_entry("gguf", source, key, {"architecture": "llama"}, variant="gguf-q") as tmp:
        (tmp / "model.safetensors").write_bytes(b"quantized")
    variant = cache.read_entry("gguf", source, "gguf-q")
    assert variant == plain.with_name(plain.name + "-gguf-q") and cache.read_entry("gguf", source) == plain
    assert (variant / "model.safetensors").read_bytes() == b"quantized"
    assert sorted(e.get("variant", "") for e in cache.list_entries()) == ["", "gguf-q"]


@pytest.mark.parametrize("change", [b"weightZ", b"weight", b"weights!"])
def test_a_checksummed_entry_whose_file_changed_is_removed(root, source, change):
    key = cache.source_key(source)
    with cache.writing_entry("gguf", source, key, variant="q", checksums=True) as tmp:
        (tmp / "model.safetensors").write_bytes(b"weights")
    folder = cache.read_entry("gguf", source, "q")
    record = json.loads((folder / cache.SOURCE_FILE).read_text())
    assert record["files"]["model.safetensors"]["bytes"] == len(b"weights")
    (folder / "model.safetensors").write_bytes(change)  # same size altered, truncated, grown
    assert cache.read_entry("gguf", source, "q") is None
    assert not folder.exists() and list((root / "gguf").iterdir()) == []  # removed, so the next load rebuilds


def test_an_unreadable_record_removes_the_entry(root, source):
    folder = cache.cached_or_convert("gguf", source, writer([]))
    (folder / cache.SOURCE_FILE).write_text("{not json")
    assert cache.read_entry("gguf", source) is None and not folder.exists()
    calls: list = []
    assert cache.cached_or_convert("gguf", source, writer(calls)) == folder and len(calls) == 1
