"""``--quantization gguf`` through its own cache entry (celeris.models.gguf_quantized): the second load reads the
stored quantized form (nothing dequantized or requantized), gives the first load's logits bit for bit, stays near
the GGUF file's size on disk, and a damaged entry is rebuilt, not trusted (tiny GGUFs written here; SmolLM2's in the
slow tier, tests/models/test_quantize_smollm2.py)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from celeris.llm import LLM
from celeris.models import cache
from celeris.models import gguf as G
from celeris.models import gguf_quantized as GQ
from celeris.models import quantize as Q
from tests.models.conftest_gguf import tiny_checkpoint, write_gguf

pytest.importorskip("gguf")
QUANT = {"ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_1", "attn_q": "Q4_1", "attn_k": "Q4_1",
         "attn_v": "Q4_1", "attn_output": "Q8_0", "token_embd": "Q8_0", "output.weight": "Q8_0"}


@pytest.fixture
def root(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("CELERIS_CACHE", str(folder))
    return folder


@pytest.fixture(params=["llama", "qwen2-untied"])
def gguf_file(request, tmp_path, root):
    """A tied Llama, and an untied Qwen2 (q/k/v biases, its own quantized head)."""
    arch = request.param.split("-")[0]
    return write_gguf(tmp_path / f"{arch}.gguf", tiny_checkpoint(arch, tie=arch == "llama"), quant=QUANT)


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Counts of the conversion's dequantization and the two quantizers (each still runs)."""
    counts: Counter = Counter()
    for module, name in ((G, "dequantize"), (Q, "int4_group_quantize"), (Q, "int8_rows")):
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return counts


def logits(llm: LLM) -> torch.Tensor:
    ids = torch.tensor([llm.tokenizer.encode("hello world, the theme")])
    with torch.no_grad():
        return llm.model(ids)


def entry_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def test_second_load_reads_the_quantized_entry(gguf_file, root, calls):
    first = LLM(gguf_file, device="cpu", quantization="gguf")
    assert calls["dequantize"] > 0 and calls["int4_group_quantize"] > 0 and calls["int8_rows"] > 0
    calls.clear()
    second = LLM(gguf_file, device="cpu", quantization="gguf")
    assert calls == Counter()  # neither dequantized nor requantized
    assert second.path == first.path and second.path.name.endswith(f"-{GQ.VARIANT}")
    assert [p.name for p in (root / "gguf").iterdir()] == [second.path.name]  # no float32 entry written
    assert torch.equal(logits(first), logits(second))
    params = first.default_params(max_tokens=8, temperature=0.0)
    assert first.generate(["hello"], params)[0].token_ids == second.generate(["hello"], params)[0].token_ids
    assert isinstance(second.model.embed_tokens, Q.Int8Embedding)
    assert isinstance(dict(second.model.named_modules())["layers.0.attn.qkv_proj"], Q.Int4Linear)
    assert second.quantization == first.quantization and second.quantization["method"] == "gguf"
    size = gguf_file.stat().st_size
    print(f"{gguf_file.name}: entry {entry_bytes(second.path)} bytes for a {size} byte GGUF")
    assert entry_bytes(second.path) <= 1.5 * size


def test_entry_stores_integers_and_matches_quantizing_the_float_model(gguf_file, root):
    q = LLM(gguf_file, device="cpu", quantization="gguf")
    with safe_open(q.path / GQ.STATE_FILE, framework="pt") as f:
        layout = json.loads(f.metadata()[GQ.LAYOUT_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
    assert layout["layers"]["layers.0.attn.qkv_proj"] == "int4"
    assert layout["layers"]["layers.0.attn.o_proj"] == "int8"  # Q8_0
    assert tensors["layers.0.attn.qkv_proj.codes"].dtype == torch.uint8
    assert tensors["embed_tokens.qweight"].dtype == torch.int8
    assert all(t.dtype in (torch.int8, torch.uint8) for t in tensors.values() if t.ndim == 2)  # no float matrix
    float_load = LLM(gguf_file, device="cpu")  # the float32 entry, beside the quantized one
    assert len(list((root / "gguf").iterdir())) == 2
    methods = Q.gguf_layer_methods(float_load.path, G.tensor_types(gguf_file))
    Q.quantize_model(float_load.model, "gguf", layer_methods=methods)
    assert torch.equal(logits(float_load), logits(q))  # the stored form is exactly the in-place transform's


def flip_a_byte(folder: Path) -> None:
    data = bytearray((folder / GQ.STATE_FILE).read_bytes())
    data[len(data) // 2] ^= 0x10
    (folder / GQ.STATE_FILE).write_bytes(bytes(data))


def truncate(folder: Path) -> None:
    data = (folder / GQ.STATE_FILE).read_bytes()
    (folder / GQ.STATE_FILE).write_bytes(data[: len(data) // 2])


def drop_record(folder: Path) -> None:
    (folder / cache.SOURCE_FILE).unlink()


def other_layout_version(folder: Path) -> None:
    """An entry another Celeris wrote (its checksums consistent, its layout version not this one)."""
    path = folder / GQ.STATE_FILE
    with safe_open(path, framework="pt") as f:
        layout = json.loads(f.metadata()[GQ.LAYOUT_KEY])
    save_file(load_file(path), path, metadata={"format": "pt", GQ.LAYOUT_KEY: json.dumps({**layout, "version": 0})})
    record = json.loads((folder / cache.SOURCE_FILE).read_text())
    record["files"][GQ.STATE_FILE] = {"bytes": path.stat().st_size, "sha256": cache.file_sha256(path)}
    (folder / cache.SOURCE_FILE).write_text(json.dumps(record))


@pytest.mark.parametrize("damage", [flip_a_byte, truncate, drop_record, other_layout_version])
def test_a_damaged_entry_is_rebuilt_not_trusted(tmp_path, root, calls, damage):
    path = write_gguf(tmp_path / "llama.gguf", tiny_checkpoint("llama"), quant=QUANT)
    first = LLM(path, device="cpu", quantization="gguf")
    want = logits(first)
    damage(first.path)
    calls.clear()
    again = LLM(path, device="cpu", quantization="gguf")
    assert calls["dequantize"] > 0 and calls["int4_group_quantize"] > 0  # converted and quantized again
    assert again.path == first.path and torch.equal(logits(again), want)
    assert cache.read_entry("gguf", path, GQ.VARIANT) == again.path  # whole again
    assert [p.name for p in (root / "gguf").iterdir()] == [again.path.name]  # nothing of the damaged one left


def test_an_unwritable_cache_keeps_the_quantized_form_in_memory(tmp_path, monkeypatch, capsys):
    path = write_gguf(tmp_path / "llama.gguf", tiny_checkpoint("llama"), quant=QUANT)
    monkeypatch.setenv("CELERIS_CACHE", str(tmp_path / "cache"))
    want = logits(LLM(path, device="cpu", quantization="gguf"))
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("CELERIS_CACHE", str(blocker))
    capsys.readouterr()
    llm = LLM(path, device="cpu", quantization="gguf")
    assert "keeping 'llama.gguf' quantized in memory for this run" in capsys.readouterr().err
    assert torch.equal(logits(llm), want) and llm.card["source"] == "llama.gguf"
    assert len(llm.generate(["hi"], llm.default_params(max_tokens=3))[0].token_ids) > 0
