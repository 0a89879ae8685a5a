"""Layers that keep a GGUF file's weight blocks as they are (Q4_0, Q4_1, Q8_0) and multiply them with the C kernel
of ``celeris.models.kernels`` (llama.cpp's scheme: int8 activations per 32-block against the blocks, integer dot
products, float32 sums).

- ``BlockLinear``: a linear layer (out, in) whose weight is ``out`` rows of ``in / 32`` blocks, a (out, row_bytes)
  uint8 buffer; float32 activations in and out.
- ``BlockEmbedding``: an embedding table kept the same way; ``rows(ids)`` gathers dequantized rows, ``head()`` a
  ``BlockLinear`` over the same storage (a tied output head).

Without the kernel (``kernels.library()`` is None: no compiler) each layer dequantizes its blocks to a float32
weight once, at construction, and uses ``F.linear`` (the same weights, 6-8x the memory, float32 activations).
``reference_matmul`` is the slow, obvious product the kernel computes (the activation quantization included), for
the tests.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants
from torch import nn

from celeris.models import kernels
from celeris.models.kernels import pointer

QK = 32  # weights per block
BLOCK_TYPES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # type name -> bytes per block of 32 weights
TYPE_IDS = {name: int(GGMLQuantizationType[name]) for name in BLOCK_TYPES}


class BlockError(ValueError):
    """A block buffer that does not fit its type and shape."""


def row_bytes(kind: str, in_features: int) -> int:
    """Bytes of one row of ``in_features`` weights in blocks of ``kind``.

    Raises:
        BlockError: an unknown type, or a width that is not a multiple of 32.
    """
    if kind not in BLOCK_TYPES:
        raise BlockError(f"GGUF block type {kind} is not one of {', '.join(BLOCK_TYPES)}")
    if in_features % QK:
        raise BlockError(f"a row of {in_features} weights is not whole blocks of {QK}")
    return in_features // QK * BLOCK_TYPES[kind]


def dequantize_blocks(blocks: torch.Tensor, kind: str, in_features: int) -> torch.Tensor:
    """(rows, row_bytes) uint8 blocks of ``kind`` -> (rows, in_features) float32, by gguf-py's own
    ``gguf.quants.dequantize`` (the format's published reader)."""
    data = blocks.contiguous().numpy()
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(data, GGMLQuantizationType[kind]),
                                                 dtype=np.float32)).reshape(blocks.shape[0], in_features)


def _check(blocks: torch.Tensor, kind: str, in_features: int) -> None:
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(kind, in_features):
        raise BlockError(f"{kind} blocks for rows of {in_features} weights must be (rows, "
                         f"{row_bytes(kind, in_features)}) uint8, not {tuple(blocks.shape)} {blocks.dtype}")


def repack(blocks: torch.Tensor, kind: str, in_features: int) -> torch.Tensor:
    """The file's blocks (N, row_bytes) uint8 repacked into the kernel's tiles (``gguf_blocks.c``): a 1-D uint8
    tensor of ``celeris_packed_bytes`` bytes, laid out for this machine's vector width.

    Raises:
        BlockError: the shape does not fit ``kind``, or a scale the tiles cannot hold (a half float overflows).
        RuntimeError: the kernel is unavailable.
    """
    _check(blocks, kind, in_features)
    lib = _library()
    n = blocks.shape[0]
    out = torch.empty(lib.celeris_packed_bytes(TYPE_IDS[kind], n, in_features), dtype=torch.uint8)
    raw = blocks.contiguous()
    rc = lib.celeris_repack(TYPE_IDS[kind], pointer(raw), n, in_features, pointer(out), torch.get_num_threads())
    if rc != 0:
        raise BlockError(f"the kernel could not repack {kind} blocks of {n} x {in_features} (code {rc})")
    return out


def packed_rows(packed: torch.Tensor, kind: str, shape: tuple[int, int], ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (n,) int64 of a repacked weight of ``shape`` (N, K), dequantized: (n, K) float32.

    Raises:
        IndexError: an id outside [0, N).
    """
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty((flat.numel(), shape[1]), dtype=torch.float32)
    if _library().celeris_packed_rows(TYPE_IDS[kind], pointer(packed), shape[0], shape[1], pointer(flat), flat.numel(),
                                      pointer(out)) != 0:
        raise IndexError(f"token id out of range [0, {shape[0]})")
    return out


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, kind: str, out_features: int) -> torch.Tensor:
    """x (M, K) float32 contiguous @ W^T for W (out_features, K) repacked (``repack``): (M, out_features) float32,
    on ``torch.get_num_threads()`` threads.

    Raises:
        RuntimeError: the kernel refused the shapes, or is unavailable.
    """
    m, k = x.shape
    y = torch.empty((m, out_features), dtype=torch.float32)
    rc = _library().celeris_packed_matmul(TYPE_IDS[kind], pointer(x), m, k, pointer(packed), out_features, pointer(y),
                                          torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"celeris_packed_matmul returned {rc} for {kind} x ({m}, {k})")
    return y


@torch.library.custom_op("celeris::block_matmul", mutates_args=())
def block_matmul_op(x: torch.Tensor, tiles: torch.Tensor, type_id: int, out_features: int) -> torch.Tensor:
    """``packed_matmul`` as a PyTorch operator, for ``torch.compile`` (a graph keeps it as one node instead of
    breaking at a ctypes call); eager passes call ``packed_matmul`` directly (an operator's dispatch costs more)."""
    kind = next(k for k, v in TYPE_IDS.items() if v == type_id)
    return packed_matmul(x.contiguous(), tiles, kind, out_features)


@block_matmul_op.register_fake
def _(x: torch.Tensor, tiles: torch.Tensor, type_id: int, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


def _library() -> ctypes.CDLL:
    lib = kernels.library()
    if lib is None:
        raise RuntimeError("the GGUF block kernel is unavailable")
    return lib


def reference_matmul(x: torch.Tensor, blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The kernel's product computed the slow, obvious way: each 32-block of x (M, K) float32 rounded to int8 as
    llama.cpp's reference ``quantize_row_q8_0`` does (float32 d = max|x| / 127, q = roundf(x * (1 / d)), halves away
    from zero), times the file's blocks dequantized by gguf-py (``dequantize_blocks``), summed in float64.
    (M, N) float32."""
    m, k = x.shape
    xb = x.float().reshape(m, k // QK, QK)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    scaled = xb * inv
    q = scaled.sign() * torch.floor(scaled.abs() + 0.5)
    xq = (q.double() * d.double()).reshape(m, k)
    return (xq @ dequantize_blocks(blocks, kind, k).double().T).float()


class BlockLinear(nn.Module):
    """y = x W^T + b with W (out, in) kept in a GGUF's blocks of ``kind``, repacked for the kernel (``tiles``, 1-D
    uint8), ``bias`` (out,) float32 or None. ``forward``: (..., in) any float dtype -> (..., out) in the input's
    dtype. Without the kernel, ``dense`` (out, in) float32 and ``F.linear`` instead.

    Args:
        blocks: (out, in / 32 * block bytes) uint8, the file's rows of blocks.

    Raises (construction):
        BlockError: a buffer that does not fit ``kind`` and ``in_features``.
    """

    def __init__(self, blocks: torch.Tensor, kind: str, in_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        _check(blocks, kind, in_features)
        self.kind, self.in_features, self.out_features = kind, in_features, blocks.shape[0]
        self.fallback = kernels.library() is None
        if self.fallback:  # PyTorch's path: the weight dequantized once
            self.register_buffer("dense", dequantize_blocks(blocks, kind, in_features))
        else:
            self.register_buffer("tiles", repack(blocks, kind, in_features))
        self.register_buffer("bias", None if bias is None else bias.float())

    @classmethod
    def sharing(cls, table: BlockEmbedding, rows: int) -> BlockLinear:
        """A layer scoring the first ``rows`` rows of ``table`` over its storage (a tied head)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.kind, module.in_features, module.out_features = table.kind, table.embedding_dim, rows
        module.fallback = table.fallback
        if module.fallback:
            module.register_buffer("dense", table.dense[:rows])
        else:
            module.register_buffer("tiles", table.tiles)
        module.register_buffer("bias", None)
        return module

    def dequantize(self) -> torch.Tensor:
        """The weight as the kernel reads it: (out, in) float32."""
        if self.fallback:
            return self.dense.clone()
        return packed_rows(self.tiles, self.kind, (self.out_features, self.in_features),
                           torch.arange(self.out_features))

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (out, in) float32, built on every read (for rare readers only)."""
        return self.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.fallback:
            out = F.linear(flat.float(), self.dense, self.bias)
        else:
            if torch.compiler.is_compiling():
                out = block_matmul_op(flat.float(), self.tiles, TYPE_IDS[self.kind], self.out_features)
            else:
                out = packed_matmul(flat.float().contiguous(), self.tiles, self.kind, self.out_features)
            if self.bias is not None:
                out += self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


class BlockEmbedding(nn.Module):
    """An embedding table (V, dim) kept in a GGUF's blocks of ``kind`` (repacked as ``BlockLinear`` does); rows
    come out in ``dtype``. ``head(rows)`` is a ``BlockLinear`` over the first ``rows`` rows of the same storage.

    Args:
        blocks: (V, dim / 32 * block bytes) uint8, the file's rows of blocks.
    """

    def __init__(self, blocks: torch.Tensor, kind: str, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        _check(blocks, kind, embedding_dim)
        self.kind, self.embedding_dim, self.dtype = kind, embedding_dim, dtype
        self.num_embeddings = blocks.shape[0]
        self.fallback = kernels.library() is None
        if self.fallback:
            self.register_buffer("dense", dequantize_blocks(blocks, kind, embedding_dim))
        else:
            self.register_buffer("tiles", repack(blocks, kind, embedding_dim))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (...,) int64 -> (..., dim) in ``dtype``: the rows dequantized.

        Raises:
            IndexError: an id outside [0, V).
        """
        if self.fallback:
            return F.embedding(ids, self.dense).to(self.dtype)
        out = packed_rows(self.tiles, self.kind, (self.num_embeddings, self.embedding_dim), ids)
        return out.reshape(*ids.shape, self.embedding_dim).to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dequantized (V, dim), built on every read: for rare readers only."""
        return self.rows(torch.arange(self.num_embeddings))

    def head(self, rows: int) -> BlockLinear:
        """A ``BlockLinear`` scoring the first ``rows`` rows, sharing this table's storage."""
        return BlockLinear.sharing(self, rows)


def quantize_blocks(weight: torch.Tensor, kind: str = "Q8_0") -> torch.Tensor:
    """A float weight (out, in) quantized by gguf-py into a GGUF's rows of ``kind`` blocks: (out, row_bytes) uint8,
    as a file would hold them (``quants.quantize``, the format's own reference quantizer).

    Raises:
        BlockError: ``in`` is not a multiple of 32 or ``kind`` is not one of ``BLOCK_TYPES``.
    """
    if kind not in BLOCK_TYPES or weight.shape[-1] % QK:
        raise BlockError(f"cannot quantize a ({', '.join(map(str, weight.shape))}) weight to {kind} blocks")
    coded = quants.quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(coded)).view(torch.uint8)


def quantize_linears(model: nn.Module, kind: str = "Q8_0", skip: tuple[str, ...] = ()) -> int:
    """Replace every ``nn.Linear`` of ``model`` (in place, on the CPU) by a ``BlockLinear`` of its weight quantized
    to ``kind`` blocks (``quantize_blocks``; the bias kept in float32), but those whose last name is in ``skip``.
    Returns the number of layers replaced.

    Raises:
        BlockError: a layer whose input width is not a multiple of 32 (checked before any is replaced).
    """
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)
               and name.rpartition(".")[2] not in skip]
    for name, m in targets:
        if m.in_features % QK:
            raise BlockError(f"{name}: {m.in_features} input columns are not whole blocks of {QK}")
    for name, m in targets:
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(parent, name.rpartition(".")[2], BlockLinear(quantize_blocks(m.weight, kind), kind, m.in_features,
                                                             None if m.bias is None else m.bias.detach()))
    return len(targets)
