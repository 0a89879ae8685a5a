"""The quantized layers that ``celeris.models.quantize`` puts in place of ``nn.Linear``: each keeps its weight in
the stored form and calls a kernel of PyTorch's own (the transform, the method names and the stored forms of a cache
entry live in ``celeris.models.quantize``).

- ``Int8Linear``: symmetric per-output-channel int8, ``w = q * scale``; ``torch._weight_int8pack_mm`` (CPU, CUDA).
- ``Int4Linear``: gpt-fast's asymmetric group-wise 4-bit, ``w = (q - 8) * scale + zero`` per group;
  ``torch._weight_int4pack_mm_for_cpu`` on a CPU, ``torch._weight_int4pack_mm`` on CUDA (each with its own packing
  of the same codes: ``_convert_weight_to_int4pack_for_cpu`` / ``_convert_weight_to_int4pack``, gpt-fast's
  ``prepare_int4_weight_and_scales_and_zeros``).
- ``Fp8Linear``: W8A8 as vLLM's ``fp8`` serves it (dynamic activation scales): float8 e4m3 weights with one scale
  per output channel, activations cast to float8 e4m3 per token with a scale from that token's largest magnitude
  (``amax / 448``), ``torch._scaled_mm`` with row-wise scales (CUDA from compute capability 8.9, and this torch's CPU
  build).
- ``Int8Embedding``: an embedding table kept as int8 rows (``--quantization gguf``'s tied table and head).

Every layer's ``dequantize()`` is the weight as its kernel reads it, and ``reference_linear`` the slow obvious
matmul the tests compare the kernels with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8_MAX = 448.0  # the largest finite float8 e4m3fn value


KERNEL_ALIGNMENT = 64  # bytes: PyTorch's CPU allocator's alignment, which its packed kernels may assume


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its data starts on a 64-byte boundary, else a copy that does: a tensor read from a
    safetensors file (8-byte aligned) reached ``torch._weight_int8pack_mm`` misaligned, and its AVX512-BF16 path
    (torch 2.13, bfloat16 activations) crashed the process with a segmentation fault on such a weight or scale."""
    return t if t.data_ptr() % KERNEL_ALIGNMENT == 0 else t.clone(memory_format=torch.contiguous_format)


class QuantizedLinear(nn.Module):
    """Common part of the weight-only linears: ``forward`` (..., in) -> (..., out) in the input's dtype."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # (M, in) in the activation dtype -> (M, out)
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The weight as the kernel sees it: (out, in) float32."""
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (out, in) in the activation dtype, built on every read: for the rare code that
        reads a head's weight (a pruned drafter's vocabulary), never on the decoding path."""
        return self.dequantize().to(self.act_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.act_dtype)
        if flat.shape[0] == 0:
            out = flat.new_zeros((0, self.out_features))
        else:
            out = self._matmul(flat.contiguous())
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of w (rows, cols) float32: q (rows, cols) int8 in [-127, 127] and scale (rows,)
    float32 with ``w ~= q * scale``."""
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class Int8Linear(QuantizedLinear):
    """Per-output-channel symmetric int8 weight (out, in) with (out,) scales: ``w = q * scale``."""

    def __init__(self, linear: nn.Linear, act_dtype: torch.dtype) -> None:
        super().__init__()
        q, scale = int8_rows(linear.weight.detach().float())
        self._fill(q, scale, None if linear.bias is None else linear.bias.detach(), act_dtype)

    @classmethod
    def from_quantized(cls, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                       act_dtype: torch.dtype) -> Int8Linear:
        """The layer from its stored form: qweight (out, in) int8, scales (out,) and bias (out,) or None (any float
        dtype, cast to ``act_dtype``); the tensors are kept, not copied, where no cast is needed and they are
        64-byte aligned (``aligned``)."""
        module = cls.__new__(cls)
        QuantizedLinear.__init__(module)
        module._fill(qweight, scales, bias, act_dtype)
        return module

    def _fill(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
              act_dtype: torch.dtype) -> None:
        self.out_features, self.in_features = qweight.shape
        self.act_dtype = act_dtype
        self.register_buffer("qweight", aligned(qweight))
        self.register_buffer("scales", aligned(scales.to(act_dtype)))
        self.register_buffer("bias", None if bias is None else bias.to(act_dtype))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.qweight, self.scales)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]


class Int8Embedding(nn.Module):
    """An embedding table kept as int8 rows with one float32 scale each; rows are dequantized when gathered.
    ``rows(ids)`` gathers dequantized rows (ids (...,) -> (..., dim)); ``head()`` is an ``Int8Linear`` over the same
    int8 storage (a tied output head)."""

    def __init__(self, embedding: nn.Embedding, dtype: torch.dtype) -> None:
        super().__init__()
        self._fill(*int8_rows(embedding.weight.detach().float()), dtype)

    @classmethod
    def from_quantized(cls, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> Int8Embedding:
        """The table from its stored form: qweight (V, dim) int8, scales (V,) float32; rows come out in ``dtype``."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._fill(qweight, scales, dtype)
        return module

    def _fill(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        self.num_embeddings, self.embedding_dim, self.dtype = qweight.shape[0], qweight.shape[1], dtype
        self.register_buffer("qweight", aligned(qweight))  # shared by ``head()``'s kernel
        self.register_buffer("scales", scales.float())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.qweight[ids].float() * self.scales[ids, None]).to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dequantized (V, dim), built on every read: for rare readers only."""
        return self.rows(torch.arange(self.num_embeddings, device=self.qweight.device))

    def head(self, rows: int, act_dtype: torch.dtype) -> Int8Linear:
        """An ``Int8Linear`` scoring the first ``rows`` rows, sharing this table's int8 storage."""
        return Int8Linear.from_quantized(self.qweight[:rows], self.scales[:rows], None, act_dtype)


def int4_group_quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpt-fast's asymmetric group quantization of w (out, in) float32, ``in % group == 0``.

    Returns:
        q (out, in) int32 in [0, 15], scales (out, in / group) and zeros (out, in / group) float32 with
        ``w ~= (q - 8) * scale + zero`` per group.
    """
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    return q, scale, lo + 8 * scale


def int4_scales_and_zeros(scale: torch.Tensor, zero: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """The int4 kernel's (in / group, out, 2) table in ``act_dtype`` from scale and zero (out, in / group)."""
    return torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(act_dtype)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int4 codes (out, in) in [0, 15] (any integer dtype, ``in`` even) as (out, in / 2) uint8, column 2j in the
    low nibble and 2j + 1 in the high one: a stored form that, unlike the kernel's packing (which depends on the
    CPU's vector width), reads back the same on every machine."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``pack_nibbles`` undone: (out, in / 2) uint8 -> (out, in) int32 codes in [0, 15]."""
    codes = torch.stack([packed & 15, packed >> 4], dim=-1)  # (out, in / 2, 2)
    return codes.reshape(packed.shape[0], -1).to(torch.int32)


def inner_k_tiles(in_features: int) -> int:
    """The CUDA int4 packing's ``innerKTiles`` for an input width (a multiple of 32): the largest of 8, 4, 2 with
    ``in_features % (16 * tiles) == 0`` (the kernel's constraint; gpt-fast uses 8)."""
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


class Int4Linear(QuantizedLinear):
    """Group-wise 4-bit weight packed for the device's kernel (``torch._weight_int4pack_mm_for_cpu`` on a CPU,
    ``torch._weight_int4pack_mm`` on CUDA, whose activations are bfloat16) plus (in / group, out, 2) scales and
    zeros (``w = (q - 8) * scale + zero``)."""

    def __init__(self, linear: nn.Linear, group: int, act_dtype: torch.dtype,
                 qsz: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        w = linear.weight.detach().float().cpu()
        q, scale, zero = qsz if qsz is not None else int4_group_quantize(w, group)
        bias = None if linear.bias is None else linear.bias.detach()
        self._fill(q, int4_scales_and_zeros(scale, zero, torch.float32), bias, group, act_dtype, linear.weight.device)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None,
                   group: int, act_dtype: torch.dtype, device: torch.device | str | None = None) -> Int4Linear:
        """The layer from its stored form (CPU tensors): codes (out, in / 2) uint8 (``pack_nibbles``),
        scales_and_zeros (in / group, out, 2) and bias (out,) or None in any float dtype (cast to ``act_dtype``).
        The codes are repacked for the kernel of ``device`` (default: the codes' device)."""
        module = cls.__new__(cls)
        QuantizedLinear.__init__(module)
        module._fill(unpack_nibbles(codes), scales_and_zeros, bias, group, act_dtype,
                     codes.device if device is None else torch.device(device))
        return module

    def _fill(self, q: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None, group: int,
              act_dtype: torch.dtype, device: torch.device) -> None:
        self.out_features, self.in_features = q.shape
        self.group, self.cuda_kernel = group, torch.device(device).type == "cuda"
        if self.cuda_kernel:  # gpt-fast's packing for the CUDA kernel: even columns in the high nibble
            self.act_dtype = torch.bfloat16
            packed = (q[:, 0::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)
            qweight = torch._convert_weight_to_int4pack(packed.contiguous(), inner_k_tiles(self.in_features))
        else:
            self.act_dtype = act_dtype
            qweight = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        self.register_buffer("qweight", qweight.to(device))
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(device, self.act_dtype))
        self.register_buffer("bias", None if bias is None else bias.to(device, self.act_dtype))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.cuda_kernel:
            return torch._weight_int4pack_mm(x, self.qweight, self.group, self.scales_and_zeros)
        return torch._weight_int4pack_mm_for_cpu(x, self.qweight, self.group, self.scales_and_zeros)

    def dequantize(self) -> torch.Tensor:
        eye = torch.eye(self.in_features, dtype=self.act_dtype, device=self.qweight.device)
        return self._matmul(eye).float().T.contiguous()  # the kernel's own reading of the packed weight


def fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float8 e4m3 per row of w (rows, cols) float32: q (rows, cols) float8_e4m3fn and scale (rows,) float32 with
    ``w ~= q * scale`` (each row's largest magnitude at 448, e4m3's largest finite value)."""
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization (vLLM's ``fp8`` activation scheme): x (M, in) ->
    (M, in) float8_e4m3fn and (M, 1) float32 scales with ``x ~= q * scale`` (``fp8_rows`` of the activations)."""
    q, scale = fp8_rows(x.float())
    return q, scale[:, None]


class Fp8Linear(QuantizedLinear):
    """W8A8 float8: weight (out, in) float8_e4m3fn with (out,) float32 scales, activations quantized per token on
    every call (``fp8_tokens``); ``torch._scaled_mm`` multiplies the two and applies both scales (row-wise), in
    bfloat16. Input and output widths must be multiples of 16 (the kernel's constraint)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        """The layer from its stored form (``celeris.models.quantize.stored_weight``): qweight (out, in)
        float8_e4m3fn (``fp8_rows``), scales (out,), bias (out,) or None."""
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.act_dtype = torch.bfloat16  # the row-wise scaled matmul's output dtype
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales.float().reshape(1, -1))  # (1, out): the kernel's scale_b
        self.register_buffer("bias", None if bias is None else bias.to(self.act_dtype))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale = fp8_tokens(x)
        return torch._scaled_mm(xq, self.qweight.t(), scale_a=x_scale, scale_b=self.scales, out_dtype=self.act_dtype)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.T



def reference_linear(x: torch.Tensor, module: QuantizedLinear) -> torch.Tensor:
    """The slow obvious reading of a quantized linear: ``x @ dequantize().T`` in float32 (tests compare the kernels
    with it); an ``Fp8Linear`` reads ``x`` as its per-token float8 form (``fp8_tokens``), as its kernel does."""
    bias = None if module.bias is None else module.bias.float()
    if isinstance(module, Fp8Linear):
        q, scale = fp8_tokens(x.reshape(-1, module.in_features))
        x = (q.float() * scale).reshape(x.shape)
    return F.linear(x.float(), module.dequantize(), bias)
