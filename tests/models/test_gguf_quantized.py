"""``--quantization gguf`` through its own cache entry (celeris.models.gguf_quantized): the first load reads the GGUF
tensor by tensor (never a float32 model) and writes exactly what quantizing the float32 model gives; the second
load reads the stored quantized form (nothing dequantized or requantized), gives the first load's logits bit for
bit, stays near the GGUF file's size on disk, and a damaged entry is rebuilt, not trusted (tiny GGUFs written here;
SmolLM2's in the slow tier, tests/models/test_quantize_smollm2.py)."""

from __future__ import annotations

import json
import tempfile
import weakref
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from celeris.llm import LLM
from celeris.models import blocks as B
from celeris.models import cache
from celeris.models import gguf as G
from celeris.models import gguf_quantized as GQ
from celeris.models import quantize as Q
from celeris.models.loader import load_any
from tests.models.conftest_gguf import tiny_checkpoint, write_gguf

pytest.importorskip("gguf")
QUANT = {"ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_1", "attn_q": "Q4_1", "attn_k": "Q4_1",
         "attn_v": "Q4_1", "attn_output": "Q8_0", "token_embd": "Q8_0", "output.weight": "Q8_0"}
# the same widths in types the kernel does not take as they are (mixed q/k/v, Q5 types): the int4 / int8 path
QUANT_INT = {"ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q5_0", "attn_q": "Q4_1", "attn_k": "Q4_0",
             "attn_v": "Q4_1", "attn_output": "Q5_1", "token_embd": "Q5_0", "output.weight": "Q5_1"}
# every type gguf.quants writes: int4 gate_up from Q4_0 + Q4_1, int8 qkv from Q4_1 + Q5_1 + Q5_0 (mixed), F16 ...
MIXED = {"ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q5_1", "attn_q": "Q4_1", "attn_k": "Q5_1",
         "attn_v": "Q5_0", "attn_output": "F16", "token_embd": "BF16", "output.weight": "F16"}


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


@pytest.fixture(params=["llama", "qwen2-untied"])
def int_gguf_file(request, tmp_path, root):
    """The same two models in types that take the int4 / int8 path."""
    arch = request.param.split("-")[0]
    return write_gguf(tmp_path / f"{arch}.gguf", tiny_checkpoint(arch, tie=arch == "llama"), quant=QUANT_INT)


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Counts of the conversion's dequantization, the two quantizers and the reads of blocks as they are."""
    counts: Counter = Counter()
    for module, name in ((G, "dequantize"), (Q, "int4_group_quantize"), (Q, "int8_rows"), (GQ, "raw_rows")):
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


@pytest.mark.parametrize("kind", ["blocks", "int"])
@pytest.mark.parametrize("model", ["llama", "qwen2-untied"])
def test_second_load_reads_the_quantized_entry(tmp_path, root, calls, kind, model):
    arch = model.split("-")[0]
    gguf_file = write_gguf(tmp_path / f"{arch}.gguf", tiny_checkpoint(arch, tie=arch == "llama"),
                           quant=QUANT if kind == "blocks" else QUANT_INT)
    first = LLM(gguf_file, device="cpu", quantization="gguf")
    if kind == "blocks":  # Q4_1 and Q8_0 kept as the file's blocks: read, not requantized
        assert calls["raw_rows"] > 0 and calls["int4_group_quantize"] == 0 and calls["int8_rows"] == 0
    else:
        assert calls["dequantize"] > 0 and calls["int4_group_quantize"] > 0 and calls["int8_rows"] > 0
    calls.clear()
    second = LLM(gguf_file, device="cpu", quantization="gguf")
    assert calls == Counter()  # neither dequantized nor requantized
    assert second.path == first.path and second.path.name.endswith(f"-{GQ.VARIANT}")
    assert [p.name for p in (root / "gguf").iterdir()] == [second.path.name]  # no float32 entry written
    assert torch.equal(logits(first), logits(second))
    params = first.default_params(max_tokens=8, temperature=0.0)
    assert first.generate(["hello"], params)[0].token_ids == second.generate(["hello"], params)[0].token_ids
    table, qkv = B.BlockEmbedding if kind == "blocks" else Q.Int8Embedding, B.BlockLinear if kind == "blocks" \
        else Q.Int4Linear
    assert isinstance(second.model.embed_tokens, table)
    assert isinstance(dict(second.model.named_modules())["layers.0.attn.qkv_proj"], qkv)
    assert second.quantization == first.quantization and second.quantization["method"] == "gguf"
    size = gguf_file.stat().st_size
    print(f"{gguf_file.name}: entry {entry_bytes(second.path)} bytes for a {size} byte GGUF")
    assert entry_bytes(second.path) <= 1.5 * size


def test_entry_stores_integers_and_matches_quantizing_the_float_model(int_gguf_file, root):
    gguf_file = int_gguf_file
    q = LLM(gguf_file, device="cpu", quantization="gguf")
    with safe_open(q.path / GQ.STATE_FILE, framework="pt") as f:
        layout = json.loads(f.metadata()[GQ.LAYOUT_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
    assert layout["layers"]["layers.0.attn.qkv_proj"] == "int4"
    assert layout["layers"]["layers.0.attn.o_proj"] == "int8"  # Q5_1
    assert tensors["layers.0.attn.qkv_proj.codes"].dtype == torch.uint8
    assert tensors["embed_tokens.qweight"].dtype == torch.int8
    assert all(t.dtype in (torch.int8, torch.uint8) for t in tensors.values() if t.ndim == 2)  # no float matrix
    float_load = LLM(gguf_file, device="cpu", onednn=False)  # the float32 entry, beside the quantized one
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
    assert calls["raw_rows"] > 0  # converted again
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


def float_path(path: Path) -> tuple[dict[str, torch.Tensor], dict, torch.nn.Module]:
    """The reference, the first load as it was: the whole GGUF dequantized to a float32 model, quantized in place by
    ``quantize_model(..., "gguf")``; returns its stored form (the linears' and the embedding's from
    ``quantize_model``, every other tensor in float32), its layout and the quantized model."""
    converted = G.convert(path)
    with tempfile.TemporaryDirectory() as tmp:
        converted.write_small_files(Path(tmp))
        model = load_any(tmp, device="cpu", dtype=torch.float32, tensors=converted.state)
        methods = Q.gguf_layer_methods(Path(tmp), G.tensor_types(path))
    del converted
    stored: dict[str, torch.Tensor] = {}
    report = Q.quantize_model(model, "gguf", layer_methods=methods, stored=stored)
    layers = {name: "int8" if isinstance(m, Q.Int8Linear) else "int4" for name, m in model.named_modules()
              if isinstance(m, Q.QuantizedLinear)}
    for name, tensor in model.state_dict().items():
        if name.rpartition(".")[0] not in (*layers, "embed_tokens"):
            stored[name] = tensor.float()
    layout = {"version": GQ.LAYOUT_VERSION, "method": "gguf", "layers": layers, "blocks": {}, "report": report}
    return stored, layout, model


@pytest.mark.parametrize("chunk", [GQ.CHUNK_BYTES, 1000])  # whole tensors; blocks of 3 rows (64 columns)
@pytest.mark.parametrize("arch,quant", [("llama", QUANT_INT), ("llama", MIXED), ("qwen2", MIXED), ("qwen3", QUANT_INT)])
def test_first_load_equals_quantizing_the_float32_model(tmp_path, root, monkeypatch, arch, quant, chunk):
    monkeypatch.setattr(GQ, "CHUNK_BYTES", chunk)
    path = write_gguf(tmp_path / f"{arch}.gguf", tiny_checkpoint(arch, tie=arch != "qwen2"), quant=quant)
    q = LLM(path, device="cpu", quantization="gguf")  # the first load: tensor by tensor
    with safe_open(q.path / GQ.STATE_FILE, framework="pt") as f:
        layout = json.loads(f.metadata()[GQ.LAYOUT_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
    want, want_layout, model = float_path(path)
    assert sorted(tensors) == sorted(want)
    for name, tensor in want.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name
    assert layout == want_layout
    assert set(layout["layers"].values()) == ({"int4", "int8"})  # both widths taken
    ids = torch.tensor([q.tokenizer.encode("hello world, the theme")])
    with torch.no_grad():
        assert torch.equal(q.model(ids), model(ids))


def float32_matrices_alive(monkeypatch) -> list[int]:
    """Spies on the dequantization (and the llama q/k unpermutation, which copies): before each tensor (or block
    of rows) is dequantized, records how many float32 matrices an earlier call returned are still alive."""
    made: list[weakref.ref] = []
    alive: list[int] = []
    for name in ("dequantize", "unpermute"):
        real = getattr(G, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            if _name == "dequantize":
                alive.append(sum(r() is not None for r in made))
            out = _real(*args, **kwargs)
            if out.ndim == 2:
                made.append(weakref.ref(out))
            return out

        monkeypatch.setattr(G, name, spy)
    return alive


@pytest.mark.parametrize("chunk", [GQ.CHUNK_BYTES, 1000])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_first_load_holds_one_float32_tensor_at_a_time(tmp_path, root, monkeypatch, arch, chunk):
    monkeypatch.setattr(GQ, "CHUNK_BYTES", chunk)
    path = write_gguf(tmp_path / f"{arch}.gguf", tiny_checkpoint(arch, tie=arch == "llama"), quant=MIXED)
    reader = G.open_reader(path)
    reads = len(reader.tensors)
    config = G.convert(path, tensors=False).config
    blocks = sum(len(GQ.chunk_rows(t, G.hf_name(t, config), config, chunk)) for t in reader.tensors)
    assert (blocks > reads) == (chunk == 1000)
    alive = float32_matrices_alive(monkeypatch)
    LLM(path, device="cpu", quantization="gguf")
    assert len(alive) == blocks  # each tensor read once, in blocks of rows when it is bigger than the chunk
    assert max(alive) == 0  # the previous tensor (block) is gone before the next is read
    alive.clear()
    float_path(path)  # the spy sees the old way's float32 model
    assert len(alive) == reads and max(alive) >= reads // 2


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_blocks_are_the_files_own_and_score_near_float32(tmp_path, root, arch):
    """Q4_1 / Q8_0 modules keep the file's blocks: dequantized by gguf-py they are the float32 model's weights bit
    for bit (llama's q/k rows unpermuted, q/k/v and gate/up rows stacked), and the logits stay near float32's
    (the kernel rounds activations to int8 per 32-block, as llama.cpp does)."""
    path = write_gguf(tmp_path / f"{arch}.gguf", tiny_checkpoint(arch, tie=arch != "qwen2"), quant=QUANT)
    q = LLM(path, device="cpu", quantization="gguf")
    with safe_open(q.path / GQ.STATE_FILE, framework="pt") as f:
        layout = json.loads(f.metadata()[GQ.LAYOUT_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
    assert layout["blocks"]["layers.0.attn.qkv_proj"] == "Q4_1" and layout["blocks"]["embed_tokens"] == "Q8_0"
    assert layout["layers"] == {}  # every linear kept as blocks
    float_load = LLM(path, device="cpu", onednn=False)
    weights = dict(float_load.model.named_parameters())
    for name, kind in layout["blocks"].items():
        got = B.dequantize_blocks(tensors[f"{name}.blocks"], kind, weights[f"{name}.weight"].shape[1])
        assert torch.equal(got, weights[f"{name}.weight"]), name
    want, got = logits(float_load)[0], logits(q)[0]
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() >= 0.8
    names = {id(m): n for n, m in q.model.named_modules()}  # a tied head is no submodule: the table's blocks
    for module in {id(m): m for m in [*q.model.modules(), q.model._celeris_quantized_head]}.values():
        if isinstance(module, B.BlockLinear):  # the slow reference in place of the kernel
            stored = tensors[f"{names.get(id(module), 'embed_tokens')}.blocks"]
            module.forward = reference_forward(module, stored[: module.out_features])
    ref = logits(q)[0]  # an activation on a rounding edge may land in the other int8 step downstream (qwen3: 2e-3)
    assert (ref - got).abs().max() <= 1e-2 * got.abs().max()
    assert (ref - got).abs().max() < 0.2 * (want - got).abs().max()  # far nearer the reference than float32 is


def reference_forward(module: B.BlockLinear, stored: torch.Tensor):  # noqa: ANN201
    def forward(x: torch.Tensor) -> torch.Tensor:
        out = B.reference_matmul(x.reshape(-1, module.in_features).float(), stored, module.kind)
        out = out if module.bias is None else out + module.bias
        return out.reshape(*x.shape[:-1], module.out_features)
    return forward
