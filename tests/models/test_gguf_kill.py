"""A GGUF conversion killed with SIGKILL at several moments never leaves a cache entry that loads, and the next
load rebuilds it (slow tier: child processes).

The child converts a tiny GGUF with the writing slowed down (a pause after the small files and after the weights,
standing in for a large file on a slow disk), so the kills land before the temporary folder exists, while it is
half written, and between the last write and the rename.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.models.conftest_gguf import tiny_checkpoint, write_gguf

pytest.importorskip("gguf")

CHILD = """
import sys, time
import celeris.models.gguf as G
write = G.Converted.write
def slow_write(self, folder):
    self.write_small_files(folder)
    time.sleep(0.4)
    card = write(self, folder)
    time.sleep(0.4)
    return card
G.Converted.write = slow_write
print("ready", flush=True)
G.prepare(G.find_gguf(sys.argv[1]))
print("done", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.2, 0.6, 1.0])
def test_killed_conversion_leaves_no_loadable_entry_and_is_rebuilt(tmp_path, monkeypatch, delay):
    from celeris.llm import LLM
    from celeris.models import cache
    from celeris.models import gguf as G

    root = tmp_path / "cache"
    monkeypatch.setenv("CELERIS_CACHE", str(root))
    path = write_gguf(tmp_path / "tiny.gguf", tiny_checkpoint("llama"), quant={"ffn_": "Q8_0"})
    env = {**os.environ, "CELERIS_CACHE": str(root), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout.readline().strip() == "ready"
    time.sleep(delay)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    finished = [p for p in (root / "gguf").glob("*") if not p.name.startswith(".")] if (root / "gguf").is_dir() else []
    if delay < 0.4:  # well before the rename (0.8 s of pauses come first): nothing but a temporary folder
        assert finished == [] and cache.read_entry("gguf", path) is None
    for entry in finished:  # a later kill may come after the rename: then the entry is whole
        assert {f.name for f in entry.iterdir()} == {"config.json", "tokenizer.json", "tokenizer_config.json",
                                                      "model.safetensors", "source.json"}
    if finished:
        return

    calls = []
    convert = G.convert
    monkeypatch.setattr(G, "convert", lambda p: calls.append(p) or convert(p))
    llm = LLM(str(path))  # the next load rebuilds the entry and removes the dead child's temporary folder
    assert calls == [path]
    assert [p.name.startswith("tiny-") for p in (root / "gguf").iterdir()] == [True]
    assert llm.generate(["hi"], llm.default_params(max_tokens=2))[0].finish_reason in ("stop", "length")
