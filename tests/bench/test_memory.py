"""Each benched system's peak RSS in a process of its own (celeris.bench.memory): the Celeris systems load the
model alone in a child and answer; llama.cpp's child imports llama_cpp alone (here a fake on its PYTHONPATH) and
never PyTorch."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.bench.test_chat import save_tiny_causal_target

pytestmark = pytest.mark.slow  # three child processes, two of them importing PyTorch and Celeris

FAKE_LLAMA_CPP = '''
import sys
assert "torch" not in sys.modules, "the llama.cpp child imported PyTorch"
class Llama:
    def __init__(self, model_path, n_ctx, **kwargs):
        self.model_path, self.kwargs = model_path, kwargs
    def token_eos(self):
        return 2
    def reset(self):
        pass
    def generate(self, prompt, **kwargs):
        while True:
            yield 7
'''


def test_every_system_reports_its_own_peak(tiny_checkpoint, tokenizer_dir, tmp_path, monkeypatch):
    from celeris.bench.memory import own_process_memory, own_process_rss
    from celeris.llm import LLM
    from celeris.models.dflash import save_dflash
    from tests.sampling.test_drafter import drafter_for

    target = save_tiny_causal_target(tiny_checkpoint, tokenizer_dir, tmp_path / "target")
    save_dflash(drafter_for(target), tmp_path / "drafter", dtype=torch.float32)
    spec = json.dumps({"model": str(tmp_path / "drafter"), "num_speculative_tokens": 3})
    options = {"model": str(tmp_path / "target"), "speculative_config": spec}
    llm = LLM(options["model"], speculative_config=spec)
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "llama_cpp.py").write_text(FAKE_LLAMA_CPP)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]))
    results = own_process_memory(llm, options, [[5, 9, 11], [4, 6]], 4, with_llamacpp=True)
    assert set(results) == {"default", "target-next-token", "llama.cpp", "llama.cpp-full-context"}
    for name, r in results.items():
        assert "error" not in r, (name, r)
        assert r["peak_rss_mb"] > 0 and r["output_tokens"] > 0
    assert results["llama.cpp"]["output_tokens"] == 2 * 4  # the fake never ends: max_tokens each
    assert results["llama.cpp"]["n_ctx"] == 3 + 4  # the longest prompt and its answer
    assert results["llama.cpp-full-context"]["n_ctx"] == llm.context_length  # Celeris's own context
    assert results["llama.cpp"]["peak_rss_mb"] < results["default"]["peak_rss_mb"]  # no PyTorch in its process
    bad = own_process_rss("nothing", options, [[5]], 2, 1)
    assert bad["error"].startswith("exit 1") and "unknown Celeris system" in bad["error"]
