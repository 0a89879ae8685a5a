"""Quantization (vLLM's ``--quantization``): a transform applied to a loaded model, never inside a model file.

``quantize_model(model, "int8" | "int4" | "int4-g64" | "int4-g128" | "fp8" | "gguf")`` replaces every ``nn.Linear``
of the model (the transformer's projections, a DFlash drafter's too) by a layer of ``celeris.models.qlinear`` that
keeps the weight quantized and calls PyTorch's own kernels, as gpt-fast does after load:

- ``int8``: symmetric per-output-channel int8, ``w = q * scale`` (q in [-127, 127]); ``torch._weight_int8pack_mm``
  (CPU and CUDA).
- ``int4`` (groups of 32 input columns; ``int4-g64``/``int4-g128`` for 64/128): asymmetric group-wise 4-bit,
  ``w = (q - 8) * scale + zero`` per group, q in [0, 15] (gpt-fast's ``group_quantize_tensor``);
  ``torch._weight_int4pack_mm_for_cpu`` on a CPU, ``torch._weight_int4pack_mm`` on CUDA.
- ``fp8``: W8A8 as vLLM serves it on H100/H200: float8 e4m3 weights per output channel, activations quantized per
  token on the fly (dynamic scales); ``torch._scaled_mm`` (CUDA from compute capability 8.9; this torch's CPU build
  runs it too, without a fast path).

The activations are cast to bfloat16 around the kernel: measured here (``scripts/quant_kernels.py``), the
weight-only kernels take a fast path for bfloat16 activations only and are several times slower than a float32
matmul with float32 ones. Everything else (norms, attention, the KV cache, the residual stream) stays in the
model's dtype. The output head (tied or not) stays as loaded unless ``quantize_lm_head``; then ``model.logits``
uses a quantized copy of the head while a tied embedding keeps its float rows (``gguf``: see ``quantize_model``).
``torch._dyn_quant_matmul_4bit`` refused the calls tried here ("Expected bias length to match output dimension",
with and without a bias), so it was not pursued.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from celeris.config import QUANTIZATION_METHODS
from celeris.models.prepack import PrepackedLinear
from celeris.models.qlinear import (
    Fp8Linear,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    QuantizedLinear,
    fp8_rows,
    int4_group_quantize,
    int4_scales_and_zeros,
    int8_rows,
    pack_nibbles,
    reference_linear,
    unpack_nibbles,
)

__all__ = ["Fp8Linear", "Int4Linear", "Int8Embedding", "Int8Linear", "QuantizedLinear", "int4_group_quantize",
           "int4_scales_and_zeros", "int8_rows", "pack_nibbles", "reference_linear", "unpack_nibbles"]

INT4_GROUPS = {"int4": 32, "int4-g64": 64, "int4-g128": 128}
METHODS = QUANTIZATION_METHODS  # "int8", the INT4_GROUPS names, "fp8" and "gguf"
# kernel family -> device type -> the torch function its layers call
KERNELS = {"int8": {"cpu": "_weight_int8pack_mm", "cuda": "_weight_int8pack_mm"},
           "int4": {"cpu": "_weight_int4pack_mm_for_cpu", "cuda": "_weight_int4pack_mm"},
           "fp8": {"cpu": "_scaled_mm", "cuda": "_scaled_mm"}}
FP8_CUDA_CAPABILITY = (8, 9)  # float8 tensor cores: Ada and Hopper on


class QuantizationError(ValueError):
    """A quantization that cannot be applied: unknown method, a shape or device the kernel does not take."""


@dataclass(frozen=True)
class Method:
    """A parsed ``--quantization`` value: ``bits`` 8 (per output channel) or 4 (``group`` input columns a scale)."""

    name: str
    bits: int
    group: int = 0

    @property
    def family(self) -> str:
        """The kernel family: ``int8``, ``int4`` or ``fp8`` (``gguf`` layers are int8 or int4 each)."""
        return "fp8" if self.name == "fp8" else "int8" if self.bits == 8 else "int4"


def parse_method(name: str) -> Method:
    """The method ``name`` names (``gguf``: bits 0, each layer's width from its GGUF block type).

    Raises:
        QuantizationError: not one of ``METHODS`` (the line lists them).
    """
    if name == "gguf":
        return Method("gguf", 0, 32)
    if name == "int8":
        return Method("int8", 8)
    if name == "fp8":
        return Method("fp8", 8)
    if name in INT4_GROUPS:
        return Method(name, 4, INT4_GROUPS[name])
    raise QuantizationError(f"unknown quantization '{name}'; Celeris has {', '.join(METHODS)}")


def check_device(method: Method, device: torch.device | str) -> None:
    """Refuse a device this build of torch has no kernel for (one line naming the kernel and the device).

    Raises:
        QuantizationError: the kernel is missing from torch, does not run on ``device``'s type, or (``fp8``) the
            CUDA device is older than compute capability 8.9.
    """
    device = torch.device(device)
    for family in ("int8", "int4") if method.bits == 0 else (method.family,):
        kernels = KERNELS[family]
        if device.type not in kernels:
            raise QuantizationError(f"--quantization {method.name} has no {device.type} kernel (it runs on "
                                    f"{', '.join(kernels)})")
        kernel = kernels[device.type]
        if not hasattr(torch, kernel):
            raise QuantizationError(f"--quantization {method.name} needs torch.{kernel}, which this torch "
                                    f"{torch.__version__} does not have")
        if family == "fp8" and device.type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            if capability < FP8_CUDA_CAPABILITY:
                raise QuantizationError(f"--quantization fp8 needs a GPU of compute capability 8.9 or later for "
                                        f"torch.{kernel}; this one has {capability[0]}.{capability[1]}")


def activation_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """bfloat16 on a CPU (the kernels' fast path); the model's half dtype, else bfloat16, on CUDA (the int4 and fp8
    layers use bfloat16 whatever this says)."""
    return dtype if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def check_shape(method: Method, name: str, linear: nn.Linear) -> None:
    """Refuse a linear the kernel cannot take: int4 with output rows not a multiple of 16, or an input width the
    group does not divide (whole groups only); fp8 with a width not a multiple of 16.

    Raises:
        QuantizationError: naming the module, its shape and the group.
    """
    if method.bits == 0:
        return  # gguf: each layer's own width (quantize_model checks the int4 ones)
    if method.family == "fp8" and (linear.in_features % 16 or linear.out_features % 16):
        raise QuantizationError(f"--quantization fp8: layer '{name}' is {linear.out_features} x "
                                f"{linear.in_features}; torch._scaled_mm takes widths that are multiples of 16; "
                                "use int8")
    if method.bits == 4 and linear.out_features % 16:
        raise QuantizationError(f"--quantization {method.name}: layer '{name}' has {linear.out_features} output "
                                "rows, not a multiple of 16 (torch._convert_weight_to_int4pack_for_cpu packs 16 "
                                "rows at a time); use int8")
    if method.bits == 4 and linear.in_features % method.group:
        raise QuantizationError(f"--quantization {method.name}: layer '{name}' has {linear.in_features} input "
                                f"columns, not a multiple of the group of {method.group} "
                                f"({'try int4 (group 32)' if linear.in_features % 32 == 0 else 'use int8'})")


STORED_ROW_DIMS = {"qweight": 0, "scales": 0, "codes": 0, "scales_and_zeros": 1, "bias": 0}  # the output rows' dim


def stored_weight(w: torch.Tensor, method: Method, act_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The stored form of a weight w (out, in) float32 (``stored_linear`` without the bias). Every tensor of it is
    computed row by row, so the forms of row blocks joined along ``STORED_ROW_DIMS`` are the form of the stacked
    rows, bit for bit (a fused projection's parts quantized one at a time)."""
    if method.family == "fp8":
        q, scale = fp8_rows(w)
        return {"qweight": q, "scales": scale}
    if method.bits == 8:
        q, scale = int8_rows(w)
        return {"qweight": q, "scales": scale.to(act_dtype)}
    q, scale, zero = int4_group_quantize(w.cpu(), method.group)  # bfloat16 tables: what both int4 kernels read
    return {"codes": pack_nibbles(q), "scales_and_zeros": int4_scales_and_zeros(scale, zero, torch.bfloat16)}


def stored_linear(linear: nn.Linear, method: Method, act_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The stored form of ``linear`` quantized by ``method`` (what the GGUF cache entry keeps): int8 ``qweight``
    (out, in) int8 and ``scales`` (out,); fp8 ``qweight`` (out, in) float8_e4m3fn and ``scales`` (out,) float32;
    int4 ``codes`` (out, in / 2) uint8 (``pack_nibbles``, on the CPU) and
    ``scales_and_zeros`` (in / group, out, 2); ``bias`` (out,) when the layer has one; floats in ``act_dtype``."""
    stored = stored_weight(linear.weight.detach().float(), method, act_dtype)
    if linear.bias is not None:
        stored["bias"] = linear.bias.detach().to(act_dtype)
    return stored


def linear_from_stored(stored: dict[str, torch.Tensor], method: Method, act_dtype: torch.dtype,
                       device: torch.device | None = None) -> QuantizedLinear:
    """The quantized layer a ``stored_linear`` form describes (its tensors kept where no cast is needed); an int4
    layer's codes are packed for ``device``'s kernel (default: where the codes are).

    Raises:
        KeyError: a tensor of the form is missing.
    """
    if method.family == "fp8":
        return Fp8Linear(stored["qweight"], stored["scales"], stored.get("bias"))
    if method.bits == 8:
        return Int8Linear.from_quantized(stored["qweight"], stored["scales"], stored.get("bias"), act_dtype)
    return Int4Linear.from_codes(stored["codes"], stored["scales_and_zeros"], stored.get("bias"), method.group,
                                 act_dtype, device)


def quantize_linear(linear: nn.Linear, method: Method, act_dtype: torch.dtype,
                    stored: dict[str, torch.Tensor] | None = None) -> QuantizedLinear:
    """One ``nn.Linear`` as its quantized replacement (same device), built from its stored form (``stored_linear``),
    which is also put in ``stored`` when given."""
    form = stored_linear(linear, method, act_dtype)
    if stored is not None:
        stored.update(form)
    return linear_from_stored(form, method, act_dtype, linear.weight.device)


def head_method(method: Method) -> Method:
    """How ``--quantize-lm-head`` stores the output head under ``method``: int8 per channel for int8 and for every
    int4 method, as llama.cpp's Q4_K_M files keep ``output.weight`` at 6 bits. Measured on SmolLM2-135M-Instruct
    (``docs/quantization.md``), a group-32 int4 head cost top-1 agreement 0.81 against float32, below int4's 0.9
    floor; an int8 head keeps the floor and still reads a quarter of the float32 head's bytes."""
    return parse_method("int8") if method.bits == 4 else method


def _head_logits(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``TransformerLM.logits`` through the quantized head: (..., hidden) -> (..., vocab_size) float32."""
    return self._celeris_quantized_head(hidden).float()


def quantize_model(model: nn.Module, method: str | Method, quantize_lm_head: bool = False,
                   layer_methods: dict[str, Method] | None = None,
                   stored: dict[str, torch.Tensor] | None = None) -> dict:
    """Replace every ``nn.Linear`` of ``model`` (in place) by its weight-only quantized form.

    The output head ``lm_head`` (or a tied head) is left alone unless ``quantize_lm_head``: then a quantized
    copy of the head rows (``vocab_size`` of them) scores the logits (``model.logits`` is rebound on the
    instance) and a tied embedding keeps its float rows for the input side. Method ``gguf`` takes each layer's
    method from ``layer_methods`` (module name -> int4 or int8 ``Method``; ``gguf_layer_methods``; int8 where it has
    none), always quantizes the head, and keeps the embedding as int8 rows (``Int8Embedding``; a tied head shares
    them), so the resident weights stay near the GGUF file's size.

    Args:
        model: a loaded eval-mode model (weights on one device).
        method: a ``METHODS`` name or a parsed ``Method``.
        stored: filled with the stored form of each replaced linear (``stored_linear``, keys ``{module}.{tensor}``)
            and of an ``Int8Embedding`` (``embed_tokens.qweight``, ``embed_tokens.scales``): what a cache entry
            writes (``celeris.models.gguf_quantized`` computes the same tensor by tensor from the file).

    Returns:
        ``{"method", "layers", "weight_bytes_before", "weight_bytes_after"}``: linears replaced and their bytes.

    Raises:
        QuantizationError: unknown method, a device without the kernel, or a layer shape the kernel cannot take
            (checked for every layer before any is replaced).
    """
    if any(isinstance(m, PrepackedLinear) for m in model.modules()):
        raise QuantizationError("the model's linear layers are prepacked for oneDNN (celeris.models.prepack); "
                                "quantize a model loaded with onednn=False (--no-onednn)")
    method = parse_method(method) if isinstance(method, str) else method
    gguf = method.bits == 0
    quantize_lm_head = quantize_lm_head or gguf
    first = next(model.parameters())
    check_device(method, first.device)
    act = activation_dtype(first.device, first.dtype)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)
               and (quantize_lm_head or name.split(".")[-1] != "lm_head")]
    chosen = {name: (layer_methods or {}).get(name, parse_method("int8")) if gguf
              else head_method(method) if name.split(".")[-1] == "lm_head" else method for name, _ in targets}
    for name, linear in targets:
        check_shape(chosen[name], name, linear)
    lm_head = getattr(model, "lm_head", None)
    if quantize_lm_head and isinstance(lm_head, nn.Linear) and lm_head.out_features != model.vocab_size:
        raise QuantizationError(f"--quantize-lm-head: the head has {lm_head.out_features} rows for a vocabulary "
                                f"of {model.vocab_size} (padded heads are not supported)")
    before = after = 0
    for name, linear in targets:
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        form: dict[str, torch.Tensor] = {}
        q = quantize_linear(linear, chosen[name], act, form)
        if stored is not None:
            stored.update({f"{name}.{k}": v for k, v in form.items()})
        before += linear.weight.numel() * linear.weight.element_size()
        after += sum(b.numel() * b.element_size() for b in q.buffers())
        setattr(parent, name.rpartition(".")[2], q)
    if quantize_lm_head and hasattr(model, "logits") and isinstance(getattr(model, "embed_tokens", None), nn.Embedding):
        after += _quantize_head(model, method, act, gguf)
    if stored is not None and isinstance(getattr(model, "embed_tokens", None), Int8Embedding):
        stored.update({f"embed_tokens.{k}": v for k, v in model.embed_tokens.named_buffers()})
    model.__dict__["_celeris_quantization"] = method.name
    return {"method": method.name, "layers": len(targets), "weight_bytes_before": before, "weight_bytes_after": after}


def quantize_head_rows(rows: torch.Tensor, method: Method, act: torch.dtype, name: str) -> QuantizedLinear:
    """Head rows (V, d) (a tied table's, or a drafter's draft vocabulary's) as a quantized linear stored as
    ``head_method(method)`` says, activations in ``act``.

    Raises:
        QuantizationError: the stored method's kernel cannot take the rows' shape (``name`` names them).
    """
    copy = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
    copy.weight = nn.Parameter(rows.detach(), requires_grad=False)
    stored_as = head_method(method)
    check_shape(stored_as, name, copy)
    return quantize_linear(copy, stored_as, act)


def _quantize_head(model: nn.Module, method: Method, act: torch.dtype, embedding: bool) -> int:
    """Score ``model.logits`` through a quantized head (and, with ``embedding``, keep the table as int8 rows);
    returns the new bytes beyond the linears already counted."""
    added = 0
    if embedding:
        table = Int8Embedding(model.embed_tokens, model.embed_tokens.weight.dtype)
        model.embed_tokens = table
        added += sum(b.numel() * b.element_size() for b in table.buffers())
    head = None
    if model.lm_head is None and not embedding:  # tied: a quantized copy of the rows scores, the float table embeds
        head = quantize_head_rows(model.embed_tokens.weight[: model.vocab_size], method, act,
                                  "lm_head (tied to embed_tokens)")
        added += sum(b.numel() * b.element_size() for b in head.buffers())
    bind_head(model, act, head)
    return added


def bind_head(model: nn.Module, act: torch.dtype, head: QuantizedLinear | None = None) -> None:
    """Make ``model.logits`` score through a quantized head (rebound on the instance): ``head`` when given, else the
    model's own quantized ``lm_head``, else (tied) an ``Int8Linear`` over the rows of its ``Int8Embedding``."""
    if head is None:
        head = model.lm_head if model.lm_head is not None else model.embed_tokens.head(model.vocab_size, act)
    model.__dict__["_celeris_quantized_head"] = head
    model.logits = types.MethodType(_head_logits, model)


GGUF_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # block types kept as group-32 int4 (Q4_1: exactly); the rest int8


def gguf_layer_methods(folder: Path, hf_types: dict[str, str]) -> dict[str, Method]:
    """Module name -> the ``Method`` a GGUF's block types give it: group-32 int4 when every tensor packed into
    the module (q, k, v of ``qkv_proj``; gate, up of ``gate_up_proj``) is ``GGUF_INT4_TYPES``, else int8.

    Args:
        folder: the converted checkpoint folder (its config.json names the format whose tensor names apply).
        hf_types: Hugging Face tensor name -> GGUF type name (``celeris.models.gguf.tensor_types``).
    """
    from celeris.models.loader import FORMATS, detect_format, read_config, rename

    kind = detect_format(read_config(folder))
    if kind is None:
        return {}
    keys = FORMATS[kind].checkpoint_keys
    parts: dict[str, list[str]] = {}
    for name, kind_name in hf_types.items():
        target = rename(name, keys)
        if target is not None and target.split("[")[0].endswith(".weight"):
            parts.setdefault(target.split("[")[0].removesuffix(".weight"), []).append(kind_name)
    int4, int8 = parse_method("int4"), parse_method("int8")
    return {module: int4 if all(t in GGUF_INT4_TYPES for t in found) else int8 for module, found in parts.items()}


def quantization_of(model: nn.Module) -> str | None:
    """The method ``quantize_model`` applied to ``model``, or None."""
    return model.__dict__.get("_celeris_quantization")


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters and buffers the model holds (each tensor storage counted once), and of the oneDNN
    weights of its prepacked linears and head (``celeris.models.prepack``: opaque tensors outside both)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers(),
              *(b for m in [model.__dict__.get("_celeris_quantized_head")] if m is not None for b in m.buffers())]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    packed = {id(m): m for m in [*model.modules(), model.__dict__.get("_celeris_packed_head")] if hasattr(m, "packed")}
    return total + sum(m.packed.numel() * m.packed.element_size() for m in packed.values())
