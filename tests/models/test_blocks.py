"""The GGUF block kernel (celeris/models/kernels/gguf_blocks.c through celeris.models.blocks) against a slow PyTorch
reference: gguf-py's own dequantization of blocks that gguf-py's own quantizer wrote, times activations rounded to
int8 per 32-block as llama.cpp's reference quantize_row_q8_0 rounds them. Every code path the C file has (AVX-512
VNNI, AVX2, plain C) is built here with the flags that select it and checked the same way; and a machine without a
compiler runs on PyTorch's path after one warning line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from celeris.models import blocks as B
from celeris.models import kernels

KINDS = ["Q4_0", "Q4_1", "Q8_0"]


def file_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """(rows, cols) random weights quantized by gguf-py into the file's blocks: (rows, row_bytes) uint8."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return torch.from_numpy(quants.quantize(w, GGMLQuantizationType[kind]).copy()).view(torch.uint8)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,cols", [(40, 64), (16, 96), (5, 32)])  # rows not a multiple of the tile; one block
def test_every_code_path_equals_the_reference(variants, monkeypatch, kind, rows, cols):
    blocks = file_blocks(kind, rows, cols)
    want_weight = B.dequantize_blocks(blocks, kind, cols)
    for name, lib in variants.items():
        monkeypatch.setattr(kernels, "library", lambda lib=lib: lib)
        layer = B.BlockLinear(blocks, kind, cols)
        # the repacked tiles read back as the file's weights (w = u * d + m: one rounding of the product)
        assert torch.allclose(layer.dequantize(), want_weight, rtol=0, atol=1e-6 * float(want_weight.abs().max()))
        for m in (1, 3, 4, 9):  # single rows, partial and whole tiles of activation rows
            x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)) * 3
            x[0, :5] = 0.0  # a block may hold zeros; an all-zero block has scale 0
            if m > 1:
                x[1, :32] = 0.0
            got, want = layer(x), B.reference_matmul(x, blocks, kind)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), (name, m)


def test_every_code_path_rounds_activations_as_the_reference(variants):
    """The activations' int8 codes, scales and code sums are the same bytes on every code path as llama.cpp's
    reference rounding (halves away from zero), exact halves included."""
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0)) * 5
    x[1, :32] = torch.cat([torch.tensor([127.0]), torch.arange(-15, 16) + 0.5])  # d = 1: x / d on exact halves
    x[2, 32:64] = 0.0  # an all-zero block: scale 0, codes 0
    xb = x.reshape(3, 3, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    scaled = xb * torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    want = (scaled.sign() * torch.floor(scaled.abs() + 0.5)).to(torch.int8).reshape(3, 96)
    for name, lib in variants.items():
        codes, scales = torch.empty(3, 96, dtype=torch.int8), torch.empty(3, 3)
        sums = torch.empty(3, 3, dtype=torch.int32)
        assert lib.celeris_quantize_activations(kernels.pointer(x), 3, 96, kernels.pointer(codes),
                                                kernels.pointer(scales), kernels.pointer(sums)) == 0
        assert torch.equal(codes, want), name
        assert torch.equal(scales, d.reshape(3, 3)), name
        assert torch.equal(sums, want.reshape(3, 3, 32).int().sum(-1)), name
    assert not torch.equal(want, torch.round(scaled).to(torch.int8).reshape(3, 96))  # halves to even would differ


def test_the_native_build_uses_the_cpus_vectors(variants):
    assert variants["plain"].celeris_simd_level() == 0
    if "avx2" in variants:
        assert variants["avx2"].celeris_simd_level() >= 1  # AVX2, or AVX-512 VNNI where haswell's flags allow none
    assert variants["native"].celeris_simd_level() >= (1 if "avx2" in variants else 0)


def test_kernel_is_near_the_float_product():
    """With the real kernel: the int8 activations keep the product within about 1% of the float32 product."""
    blocks = file_blocks("Q4_1", 64, 256)
    x = torch.randn(8, 256)
    want = x @ B.dequantize_blocks(blocks, "Q4_1", 256).T
    got = B.BlockLinear(blocks, "Q4_1", 256)(x)
    assert (got - want).norm() < 0.02 * want.norm()


def test_embedding_rows_and_tied_head_share_the_blocks():
    blocks = file_blocks("Q8_0", 50, 64)
    table = B.BlockEmbedding(blocks, "Q8_0", 64, torch.float32)
    ids = torch.tensor([[0, 49, 7], [7, 7, 3]])
    want = B.dequantize_blocks(blocks, "Q8_0", 64)
    assert torch.allclose(table(ids), want[ids], rtol=0, atol=1e-6 * float(want.abs().max()))
    head = table.head(48)  # the first 48 rows score
    if not head.fallback:
        assert head.tiles.data_ptr() == table.tiles.data_ptr()  # no second copy
    x = torch.randn(2, 64)
    assert torch.allclose(head(x), B.reference_matmul(x, blocks[:48], "Q8_0"), rtol=1e-5, atol=1e-4)
    with pytest.raises(IndexError, match="out of range"):
        table(torch.tensor([50]))


def test_bad_blocks_are_refused():
    with pytest.raises(B.BlockError, match="not whole blocks"):
        B.row_bytes("Q4_0", 48)
    with pytest.raises(B.BlockError, match="not one of"):
        B.row_bytes("Q6_K", 64)
    with pytest.raises(B.BlockError, match=r"must be \(rows, 36\) uint8"):
        B.BlockLinear(torch.zeros(4, 40, dtype=torch.uint8), "Q4_0", 64)


def test_without_a_compiler_one_warning_and_the_pytorch_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CELERIS_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    kernels.library.cache_clear()
    try:
        assert kernels.library() is None and kernels.library() is None
        err = capsys.readouterr().err
        assert err.count("warning: the GGUF block kernel is unavailable") == 1 and "Traceback" not in err
        blocks = file_blocks("Q4_1", 8, 64)
        layer = B.BlockLinear(blocks, "Q4_1", 64)
        assert layer.fallback
        x = torch.randn(3, 64)
        assert torch.allclose(layer(x), x @ B.dequantize_blocks(blocks, "Q4_1", 64).T, atol=1e-5)
        assert not list(tmp_path.rglob("*.so*"))  # nothing half-built left behind
    finally:
        kernels.library.cache_clear()


def test_the_build_is_cached_and_written_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("CELERIS_CACHE", str(tmp_path))
    kernels.library.cache_clear()
    try:
        if kernels.library() is None:
            pytest.skip("no working C compiler")
        built = list((tmp_path / "kernels").iterdir())
        assert len(built) == 1 and built[0].suffix == ".so"  # no temporary file left
        stamp = built[0].stat().st_mtime_ns
        kernels.library.cache_clear()
        assert kernels.library() is not None and built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    finally:
        kernels.library.cache_clear()


def test_float_linears_become_q8_0_blocks_as_gguf_py_quantizes_them():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8, bias=False))
    x = torch.randn(3, 64)
    want = model(x)
    assert B.quantize_linears(model, "Q8_0") == 2
    assert all(isinstance(model[i], B.BlockLinear) for i in (0, 2))
    torch.testing.assert_close(model(x), want, atol=0.02 * float(want.abs().max()), rtol=0)  # Q8_0: 8 bits a weight
    with pytest.raises(B.BlockError, match="not whole blocks of 32"):
        B.quantize_linears(torch.nn.Sequential(torch.nn.Linear(48, 4)))
    with pytest.raises(B.BlockError, match="cannot quantize"):
        B.quantize_blocks(torch.randn(4, 48))
