"""The small operators of the CPU's fast pass (``kernels/decode_ops.c``): RMSNorm, silu(gate) * up and attention over a
KV cache, in float32, for models whose linears run on the GGUF block kernel.

Between two block products (each streams up to megabytes of weights), PyTorch's operator calls run with cold
caches at several times their warm cost (measured: ``F.rms_norm`` of one 576-wide row 10.6 us warm, 34.8 us after a
cache-evicting read; SDPA of one query over 160 keys 23 us and 52 us), and a width-1 pass of SmolLM2 makes about 300
of them. ``enable(model)`` switches the model's ``RMSNorm``, ``Attention`` and ``MLP`` modules onto these kernels
(their ``fast`` attribute); each call falls back to PyTorch's own operator for a shape or dtype it does not take
(a non-float32 tensor, a CUDA tensor), and the kernels compute the same functions (``tests/models/test_fast_ops.py``
compares them with PyTorch's). The C attention gives a query the same numbers whatever the width of its pass and
however its row is padded, so verified decoding equals next-token decoding and a batch gives each row its solo
numbers, for a prefill of any length too: SDPA's flash kernel rounds by its blocks of keys, which depend on the
pass's length and padding, and the int8 activations of the block kernel can turn that into a different near-tie.
Measured (1 thread, one SmolLM2 layer's causal prefill attention, 9 heads over 3 K/V heads): 64 tokens 0.29 ms in C
against 0.18 on SDPA, 256 tokens 3.1 ms against 2.1, 512 tokens 12.1 ms against 9.6.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import itertools

import torch
from torch import nn

from celeris.models import kernels
from celeris.models.blocks import TYPE_IDS
from celeris.models.kernels import pointer


def _fits(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x (..., dim) float32 normalized and scaled by weight (dim,): same shape; None where the kernel does not
    apply (the caller uses PyTorch's)."""
    lib = kernels.library()
    if lib is None or not _fits(x, weight):
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    lib.celeris_rms_norm(pointer(x), pointer(weight), x.numel() // x.shape[-1], x.shape[-1], eps, pointer(out))
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``: (..., n) -> (...) int64, the first index of the largest value (a NaN counting as the
    largest), torch's rule; on the kernel for a float32 CPU tensor (one row of SmolLM2's 49,152 logits: 43 us in
    torch's reduction, about 4 in the kernel), torch's own elsewhere. ``tests/models/test_fast_ops.py`` holds it to
    torch's on ties, NaNs, infinities and signed zeros on every build."""
    lib = kernels.library()
    if lib is None or not _fits(x) or x.dim() == 0 or x.shape[-1] == 0:
        return x.argmax(-1)
    x = x.contiguous()
    out = torch.empty(x.shape[:-1], dtype=torch.long)
    lib.celeris_argmax_rows(pointer(x), x.numel() // x.shape[-1], x.shape[-1], pointer(out))
    return out


@functools.lru_cache(maxsize=16)
def _banned(ids: tuple[int, ...]) -> torch.Tensor | None:
    """The banned ids as the kernel reads them (int64), made once per set (a model bans the same few every step)."""
    return torch.tensor(ids, dtype=torch.int64) if ids else None


def _per_row(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A penalty's (rows,) float32 values from one per row or one for all (any shape of that many elements)."""
    t = t.reshape(-1)
    return t.contiguous() if t.numel() == rows else t.expand(rows).contiguous()


def penalized_argmax(logits: torch.Tensor, counts: torch.Tensor | None, frequency: torch.Tensor | None,
                     presence: torch.Tensor | None, banned_ids: list[int],
                     extra: list[list[tuple[int, int]]] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Greedy decoding's token per row in one kernel pass: the argmax (torch's rule) of ``logits`` (B, V) float32
    less ``frequency`` (B,) x ``counts`` (B, V) and ``presence`` (B,) x (counts > 0) (each None: left out), the
    ``banned_ids`` at -inf: the same float operations as ``celeris.sampling.step.apply_penalties`` and the ban,
    so the same ids. ``counts`` may be (1, V), one row for all; ``extra``: per row, (token, n) pairs that row counts
    n more times (verified decoding's positions after drafts: ``celeris.sampling.verified.penalize_along``).
    Returns (ids (B,) int64, their penalized logits (B,) float32), or None where the kernel does not apply (the
    caller takes PyTorch's path)."""
    lib = kernels.library()
    tensors = [t for t in (logits, counts, frequency, presence) if t is not None]
    if lib is None or not _fits(*tensors) or logits.dim() != 2 or (counts is None) != (frequency is None and
                                                                                       presence is None):
        return None
    b, v = logits.shape
    if counts is not None and (counts.dim() != 2 or counts.shape[1] != v or counts.shape[0] not in (1, b)):
        return None
    if extra is not None and (counts is None or len(extra) != b):
        return None
    logits = logits.contiguous()
    counts = None if counts is None else counts.contiguous()
    frequency = None if frequency is None else _per_row(frequency, b)
    presence = None if presence is None else _per_row(presence, b)
    banned = _banned(tuple(banned_ids))
    table = None  # offsets, tokens, counts (the kernel's ``extra``), when some row counts a token more
    if extra is not None and any(extra):
        flat = [pair for row in extra for pair in row]
        table = torch.tensor([0, *itertools.accumulate(len(e) for e in extra), *(t for t, _ in flat),
                              *(n for _, n in flat)], dtype=torch.int64)
    ids, values, scratch = torch.empty(b, dtype=torch.int64), torch.empty(b), torch.empty(v)
    lib.celeris_penalized_argmax(pointer(logits), b, v, None if counts is None else pointer(counts),
                                 0 if counts is None or counts.shape[0] == 1 else v,
                                 None if frequency is None else pointer(frequency),
                                 None if presence is None else pointer(presence),
                                 None if table is None else pointer(table), None if banned is None else pointer(banned),
                                 len(banned_ids), pointer(scratch), pointer(ids), pointer(values))
    return ids, values


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up (..., 2n) float32 -> silu(gate) * up (..., n); None where the kernel does not apply."""
    lib = kernels.library()
    if lib is None or not _fits(gate_up):
        return None
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], n))
    lib.celeris_silu_mul(pointer(gate_up), gate_up.numel() // (2 * n), n, pointer(out))
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
              is_causal: bool) -> torch.Tensor | None:
    """SDPA (default scale 1 / sqrt(D)) of q (B, H, Lq, D) over k, v (B, H_kv, T, D) with grouped K/V heads and a
    bool ``attn_mask`` (Lq, T) or broadcastable (B or 1, 1, Lq, T) (True: attend), or None: (B, Lq, H * D) float32,
    the layout the output projection reads; ``is_causal`` as SDPA's (query i attends keys up to i + T - Lq, the
    mask None). None where the kernel does not apply: a mask of another shape or dtype, another dtype or device."""
    lib = kernels.library()
    b, h, lq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    if lib is None or not _fits(q, k, v) or h % hkv or not _mask_ok(attn_mask, b, lq, t) or k.shape[0] != b \
            or v.shape[:3] != k.shape[:3]:
        return None
    if is_causal:  # SDPA's is_causal: query i attends keys up to i + T - Lq
        attn_mask = torch.ones(lq, t, dtype=torch.bool).tril(t - lq)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = q.new_empty((b, lq, h * d))
    mask = _mask_args(attn_mask, lq, t)
    rc = lib.celeris_attention(pointer(q), q.stride(0), q.stride(1), q.stride(2), pointer(k), k.stride(0), k.stride(1),
                               k.stride(2), pointer(v), v.stride(0), v.stride(1), v.stride(2), *mask, b, h, hkv, lq,
                               t, d, d ** -0.5, pointer(out), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("celeris_attention could not allocate its scratch rows")
    return out


def _mask_args(attn_mask: torch.Tensor | None, lq: int, t: int) -> tuple[ctypes.c_void_p | None, int, int,
                                                                         int]:
    """(pointer, batch, query and key strides) of a bool mask (Lq, T) or (B or 1, 1, Lq, T), the kernels' mask
    arguments; (None, 0, 0, 0) for no mask. The pointer is into ``attn_mask``'s own memory (a view, no copy)."""
    if attn_mask is None:
        return None, 0, 0, 0
    m = attn_mask if attn_mask.dim() == 4 else attn_mask[None, None]
    m = m.expand(m.shape[0], 1, lq, t).view(torch.uint8)
    return pointer(m), m.stride(0) if m.shape[0] > 1 else 0, m.stride(2), m.stride(3)


def _mask_ok(attn_mask: torch.Tensor | None, b: int, lq: int, t: int) -> bool:
    """A mask the kernels take for B rows of Lq queries over T keys: None, bool (Lq, T), or bool (B or 1, 1, Lq, T)
    (each dimension broadcastable as ``_mask_args`` expands it)."""
    if attn_mask is None:
        return True
    if attn_mask.dtype != torch.bool:
        return False
    shape = attn_mask.shape
    if attn_mask.dim() == 2:
        return shape[0] in (1, lq) and shape[1] in (1, t)
    return attn_mask.dim() == 4 and shape[0] in (1, b) and shape[1] == 1 and shape[2] in (1, lq) and shape[3] in (1, t)


def rope_cache_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                         values: torch.Tensor, window: tuple[int, int] | torch.Tensor, attn_mask: torch.Tensor | None,
                         num_heads: int, num_kv_heads: int) -> torch.Tensor | None:
    """What ``Attention.forward`` does after its q/k/v projection for a cached window pass, in one call: RoPE on
    the queries and keys (cos, sin (B, 1, L, D), every dimension rotated), the keys and values written into one
    layer's cache ``keys`` / ``values`` (B, H_kv, T, D) at the window's columns (a span (w0, w1) or per-row columns
    (B, L) int64, as ``layers.update_cache`` writes them), and attention of the queries over all T cached positions
    with ``attn_mask`` (as ``attention`` takes it). qkv (B, L, (H + 2 H_kv) * D) float32 -> (B, L, H * D); None
    where the kernel does not apply (then nothing was written).

    Raises:
        IndexError: a window column outside the cache.
    """
    lib = kernels.library()
    b, lq, _ = qkv.shape
    if lib is None or not _fits(qkv, cos, sin, keys, values) or keys.stride(-1) != 1 or values.stride(-1) != 1 \
            or num_heads % num_kv_heads or not _window_ok(b, lq, keys, values, window, attn_mask):
        return None
    t, d = keys.shape[2], keys.shape[3]
    qkv = qkv.contiguous()
    out = qkv.new_empty((b, lq, num_heads * d))
    args, _held = _window_args(b, lq, cos, sin, keys, values, window, attn_mask)
    rc = lib.celeris_rope_cache_attention(pointer(qkv), b, lq, num_heads, num_kv_heads, d, *args, d ** -0.5,
                                          pointer(out), torch.get_num_threads())
    if rc == -1:
        raise IndexError(f"a window column is outside the cache of {t} positions")
    if rc != 0:
        raise MemoryError("celeris_rope_cache_attention could not allocate its scratch rows")
    return out


def _window_ok(b: int, lq: int, keys: torch.Tensor, values: torch.Tensor, window: tuple[int, int] | torch.Tensor,
               attn_mask: torch.Tensor | None) -> bool:
    """Whether a cached window pass of B rows of Lq queries fits the kernels: caches of B rows alike, a span of Lq
    columns or (B, Lq) columns, and a mask ``_mask_ok`` takes."""
    cols_ok = window.shape == (b, lq) if isinstance(window, torch.Tensor) else window[1] - window[0] == lq
    return keys.shape[0] == b and values.shape[:3] == keys.shape[:3] and cols_ok \
        and _mask_ok(attn_mask, b, lq, keys.shape[2])


def _window_args(b: int, lq: int, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 window: tuple[int, int] | torch.Tensor, attn_mask: torch.Tensor | None) -> tuple[tuple, tuple]:
    """The kernels' arguments from cos, sin to the mask (``celeris_rope_cache_attention``'s order) for a cached
    window pass of B rows of L queries, and the tensors made for them (the caller holds them until its call
    returns: the arguments are bare pointers)."""
    t, d = keys.shape[2], keys.shape[3]
    cols = (window if isinstance(window, torch.Tensor) else torch.arange(*window)[None].expand(b, lq)) \
        .to(torch.int64).contiguous()
    cos, sin = cos.expand(b, 1, lq, d), sin.expand(b, 1, lq, d)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return (pointer(cos), pointer(sin), cos.stride(0), cos.stride(2), pointer(keys), keys.stride(0), keys.stride(1),
            keys.stride(2), pointer(values), values.stride(0), values.stride(1), values.stride(2), t, pointer(cols),
            *_mask_args(attn_mask, lq, t)), (cols, cos, sin)


def fused_layer_fits(block: nn.Module) -> bool:
    """Whether ``celeris_decoder_layer`` computes ``block`` (a ``layers.Block``): RMSNorms, attention without q/k
    norms over the whole head dimension, SwiGLU, and every linear a ``BlockLinear`` on the kernel without a bias."""
    attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
    linears = [getattr(attn, "qkv_proj", None), getattr(attn, "o_proj", None), getattr(mlp, "gate_up_proj", None),
               getattr(mlp, "down_proj", None)]
    if not all(getattr(m, "tiles", None) is not None and getattr(m, "bias", 0) is None for m in linears) \
            or attn.q_norm is not None or attn.rotary_dim != attn.head_dim or attn.num_heads % attn.num_kv_heads \
            or type(mlp).__name__ != "MLP":
        return False
    qkv, o, gu, down = linears
    dim, heads = qkv.in_features, (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim
    norms = (block.attn_norm, block.mlp_norm)
    return qkv.out_features == heads and o.in_features == attn.num_heads * attn.head_dim and o.out_features == dim \
        and gu.in_features == dim and gu.out_features == 2 * down.in_features and down.out_features == dim \
        and all(getattr(n, "weight", None) is not None and n.weight.dtype == torch.float32 and n.weight.numel() == dim
                for n in norms) and block.attn_norm.eps == block.mlp_norm.eps  # the kernel takes one eps


def decoder_layer(block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attn_mask: torch.Tensor | None, cache: object = None, layer_idx: int = 0,
                  window: tuple[int, int] | torch.Tensor | None = None) -> torch.Tensor | None:
    """``block`` (``fused_layer_fits``) on x (B, L, d) float32 for a cached window pass (``Attention.forward``'s
    arguments), in one kernel call (``celeris_decoder_layer``): (B, L, d), equal bit for bit to the module path;
    None where it does not apply (then nothing was written).

    Raises:
        IndexError: a window column outside the cache.
    """
    lib = kernels.library()
    if lib is None or cache is None or window is None:
        return None
    keys, values = cache.keys[layer_idx], cache.values[layer_idx]
    if not _fits(x, cos, sin, keys, values) or keys.stride(-1) != 1 or values.stride(-1) != 1 \
            or not _window_ok(x.shape[0], x.shape[1], keys, values, window, attn_mask):
        return None
    attn, mlp = block.attn, block.mlp
    b, lq, dim = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    qkv, o, gu, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
    args, _held = _window_args(b, lq, cos, sin, keys, values, window, attn_mask)
    rc = lib.celeris_decoder_layer(
        pointer(x), b, lq, dim, pointer(block.attn_norm.weight), pointer(block.mlp_norm.weight), block.attn_norm.eps,
        TYPE_IDS[qkv.kind], pointer(qkv.tiles), TYPE_IDS[o.kind], pointer(o.tiles), TYPE_IDS[gu.kind],
        pointer(gu.tiles), TYPE_IDS[down.kind], pointer(down.tiles), attn.num_heads, attn.num_kv_heads,
        attn.head_dim, down.in_features, *args, attn.head_dim ** -0.5, pointer(out), torch.get_num_threads())
    _check_layer_rc(rc, "celeris_decoder_layer", keys.shape[2])
    return out


def _check_layer_rc(rc: int, kernel: str, positions: int) -> None:
    """Raise for a one-call layer kernel's return code: -1 IndexError (a window column outside the cache), -3
    RuntimeError (a product refused its shape: ``fused_layer_fits`` let it in), another non-zero MemoryError."""
    if rc == -1:
        raise IndexError(f"a window column is outside the cache of {positions} positions")
    if rc == -3:
        raise RuntimeError(f"{kernel}: a weight's product refused its shape (fused_layer_fits let it in)")
    if rc != 0:
        raise MemoryError(f"{kernel} could not allocate its scratch rows")


class LayerStack:
    """A model's decoder layers (each ``fused_layer_fits``) as one kernel call a pass (``celeris_decoder_stack``):
    the per-layer Python work of ``decoder_layer`` (about 55 us a layer, 1.7 ms of SmolLM2's 10 ms width-1 pass)
    done once. The weights' addresses are read once, here (``enable`` builds the stack again); the caches'
    addresses every pass. Same numbers as calling ``decoder_layer`` layer after layer, bit for bit."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.blocks = blocks
        rows, self._held = [], []
        for b in blocks:
            linears = (b.attn.qkv_proj, b.attn.o_proj, b.mlp.gate_up_proj, b.mlp.down_proj)
            self._held += [b.attn_norm.weight, b.mlp_norm.weight, *(m.tiles for m in linears)]  # kept alive
            rows.append([b.attn_norm.weight.data_ptr(), b.mlp_norm.weight.data_ptr(),
                         *(v for m in linears for v in (TYPE_IDS[m.kind], m.tiles.data_ptr())), 0, 0, 0])
        # (n, 13): STACK_COLUMNS in decode_ops.c; the caches' columns (10, 11) and the capture's (12) set per pass
        self.table = torch.tensor(rows, dtype=torch.int64)
        first = blocks[0]
        self.eps, self.dims = first.attn_norm.eps, (first.attn.num_heads, first.attn.num_kv_heads,
                                                    first.attn.head_dim, first.mlp.down_proj.in_features)

    def __deepcopy__(self, memo: dict) -> LayerStack:
        """A copy over the copied layers (a model's deep copy): its table must hold the copies' addresses, not
        the original's, which may be freed."""
        return LayerStack([copy.deepcopy(b, memo) for b in self.blocks])

    def _caches(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor | None:
        """(n, 2) int64 addresses of each layer's key and value cache, or None when the layers' caches differ in
        shape, strides, dtype or device (or a last dimension is not contiguous); checked again only when the cache
        tensors are not the objects of the last pass (an engine's KV pool hands out the same views step after
        step)."""
        last = getattr(self, "_last", None)
        if last is not None and len(last[0]) == len(keys) and all(a is b for a, b in zip(last[0], keys, strict=True)) \
                and all(a is b for a, b in zip(last[1], values, strict=True)):
            return last[2]
        k0, v0 = keys[0], values[0]
        if k0.stride(-1) != 1 or v0.stride(-1) != 1 \
                or any(k.shape != k0.shape or k.stride() != k0.stride() or k.dtype != k0.dtype or k.device != k0.device
                       for k in keys) \
                or any(v.shape != v0.shape or v.stride() != v0.stride() or v.dtype != v0.dtype or v.device != v0.device
                       for v in values):
            return None
        caches = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in zip(keys, values, strict=True)])
        self._last = (list(keys), list(values), caches)  # held: the addresses stay those tensors'
        return caches

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None,
                 cache: object, window: tuple[int, int] | torch.Tensor | None,
                 capture: dict[int, torch.Tensor | None] | None = None,
                 final_norm: nn.Module | None = None) -> torch.Tensor | None:
        """Every layer on x (B, L, d) float32 for a cached window pass: (B, L, d) before the final norm, or after
        ``final_norm`` (the model's ``RMSNorm``, on the kernel: the same call as its module's, without the module's
        dispatch after a pass has evicted the caches), with ``capture`` (layer index -> None) filled with those
        layers' outputs (B, L, d); None where it does not apply (a layer switched off its kernel, a cache of other
        strides: nothing was written).

        Raises:
            IndexError: a window column outside the cache.
        """
        lib = kernels.library()
        if lib is None or cache is None or window is None or not all(b.fused for b in self.blocks):
            return None
        keys, values = cache.keys, cache.values
        n = len(self.blocks)
        if len(keys) != n or len(values) != n or not _fits(x, cos, sin, keys[0], values[0]) \
                or not _window_ok(x.shape[0], x.shape[1], keys[0], values[0], window, attn_mask):
            return None
        caches = self._caches(keys, values)
        if caches is None:
            return None
        b, lq, dim = x.shape
        x = x.contiguous()
        out = torch.empty_like(x)
        table = self.table.clone()
        table[:, 10:12] = caches
        for i in capture or ():
            if 0 <= i < n:
                capture[i] = torch.empty_like(x)
                table[i, 12] = capture[i].data_ptr()
        args, _held = _window_args(b, lq, cos, sin, keys[0], values[0], window, attn_mask)
        h, hkv, d, inter = self.dims
        # _window_args' order: cos, sin, cb, cl, k, kb, kh, kt, v, vb, vh, vt, T, cols, mask, mb, ml, mt
        rc = lib.celeris_decoder_stack(n, pointer(table), pointer(x), b, lq, dim, self.eps, h, hkv, d, inter,
                                       *args[:4], *args[5:8], *args[9:], d ** -0.5, pointer(out),
                                       torch.get_num_threads())
        _check_layer_rc(rc, "celeris_decoder_stack", keys[0].shape[2])
        if final_norm is not None:  # in place: the kernel sums a row's squares before it writes the row
            w = final_norm.weight
            if not (getattr(final_norm, "fast", False) and _fits(w) and w.numel() == dim):
                return final_norm(out)
            lib.celeris_rms_norm(pointer(out), pointer(w), b * lq, dim, final_norm.eps, pointer(out))
        return out


def enable(model: nn.Module) -> bool:
    """Switch every module of ``model`` with a ``fast`` attribute (``RMSNorm``, ``Attention``, ``MLP``) onto these
    kernels; returns False (and changes nothing) when the kernel library is unavailable."""
    if kernels.library() is None:
        return False
    for module in model.modules():
        if hasattr(module, "fast"):
            module.fast = True
        if hasattr(module, "fused"):  # a decoder layer the one-call kernel computes
            module.fused = fused_layer_fits(module)
    for module in model.modules():  # after the layers' own flags: a model whose layers all fit, one call a pass
        if hasattr(module, "layer_stack"):
            layers = list(module.layers)
            module.layer_stack = LayerStack(layers) if layers and all(b.fused for b in layers) else None
        if hasattr(module, "draft_stack"):  # a DFlash drafter
            layers = list(module.layers)
            module.draft_stack = DraftStack(layers) if layers and all(draft_layer_fits(b) for b in layers) else None
    return True


def draft_layer_fits(layer: nn.Module) -> bool:
    """Whether ``celeris_dflash_stack`` computes a DFlash drafter layer (``celeris.models.dflash.DFlashLayer``):
    every projection a ``BlockLinear`` on the kernel without a bias, gate and up fused, float32 norms of one eps,
    and its modules on the fast operators (``enable``), so that the call equals the modules' path bit for bit."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
        [getattr(mlp, n, None) for n in ("gate_up_proj", "down_proj")]
    if not all(getattr(m, "tiles", None) is not None and getattr(m, "bias", 0) is None for m in linears):
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
    d, dim = linears[0].in_features, attn.head_dim
    return all(getattr(m, "fast", False) for m in (*norms, attn, mlp)) and all(
        n.weight.dtype == torch.float32 and n.eps == norms[0].eps for n in norms) \
        and norms[0].weight.numel() == d == norms[1].weight.numel() and norms[2].weight.numel() == dim \
        and norms[3].weight.numel() == dim


class DraftStack:
    """A DFlash drafter's layers (each ``draft_layer_fits``) as one kernel call for one row's draft block against
    its cache bound to buffers (``celeris_dflash_stack``): a drafter call otherwise makes some thirty Python-level
    calls a layer, each slowed by the caches the target's pass evicted (measured: 2.5 ms of a 3.6 ms call on
    SmolLM2's drafter, its weights 13 MB). Same numbers as the modules, bit for bit."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers, rows, self._held, self._fast = layers, [], [], []
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm, a.q_norm, a.k_norm)
            self._fast += [*norms, a, m]  # modules whose fast flag the call checks (the rest is fixed at enable)
            linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_up_proj, m.down_proj)
            self._held += [*(n.weight for n in norms), *(x.tiles for x in linears)]  # kept alive
            rows.append([*(n.weight.data_ptr() for n in norms),
                         *(v for x in linears for v in (TYPE_IDS[x.kind], x.tiles.data_ptr())), 0, 0])
        self.table = torch.tensor(rows, dtype=torch.int64)  # (n, 18): DRAFT_COLUMNS in decode_ops.c
        a = layers[0].self_attn
        self.eps, self.dims = layers[0].input_layernorm.eps, (a.num_heads, a.num_kv_heads, a.head_dim,
                                                               layers[0].mlp.down_proj.in_features)

    def __deepcopy__(self, memo: dict) -> DraftStack:
        """A copy over the copied layers (its table must hold the copies' addresses)."""
        return DraftStack([copy.deepcopy(layer, memo) for layer in self.layers])

    def __call__(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attn_mask: torch.Tensor | None, cache: object) -> torch.Tensor | None:
        """The layers on the block x (1, Lq, d) float32 with the projected context ctx (1, Lc, d) and cos, sin
        (1, 1, Lc + Lq, D): (1, Lq, d) before the final norm, the cache's buffers written at its next Lc + Lq
        columns (the caller counts them: ``DraftKVCache.advance``); None where it does not apply (a mask, a batch,
        a cache grown in tensors of its own, other dtypes, a module switched off the fast operators since
        ``enable`` built the stack: nothing was written).

        Raises:
            ValueError: the cache's buffers hold fewer columns than the call needs (``DraftKVCache.update``'s).
        """
        lib = kernels.library()
        if lib is None or attn_mask is not None or getattr(cache, "filled", None) is None or x.shape[0] != 1 \
                or ctx.shape[0] != 1 or not _fits(x, ctx, cos, sin) or not all(m.fast for m in self._fast):
            return None
        keys, values = cache.keys, cache.values
        k0 = keys[0] if keys else None
        if len(keys) != len(self.layers) or len(values) != len(keys) or k0.shape[0] != 1 or k0.stride(-1) != 1 \
                or not _fits(k0) or any(t.shape != k0.shape or t.stride() != k0.stride() or t.dtype != k0.dtype
                                        for t in (*keys, *values)):
            return None
        h, hkv, d, inter = self.dims
        lq, lc, dim = x.shape[1], ctx.shape[1], x.shape[2]
        if cache.filled + lc + lq > k0.shape[2]:
            raise ValueError(f"the drafter's cache holds {k0.shape[2]} columns, a call needs {cache.filled + lc + lq}")
        table = self.table.clone()
        table[:, 16] = torch.tensor([t.data_ptr() for t in keys])
        table[:, 17] = torch.tensor([t.data_ptr() for t in values])
        x, ctx = x.contiguous(), ctx.contiguous()
        cos, sin = cos[0, 0].contiguous(), sin[0, 0].contiguous()  # (Lc + Lq, D)
        out = torch.empty_like(x)
        rc = lib.celeris_dflash_stack(len(self.layers), pointer(table), pointer(x), lq, pointer(ctx), lc, dim,
                                      self.eps, h, hkv, d, inter, pointer(cos), pointer(sin), cache.filled,
                                      k0.shape[2], k0.stride(1), k0.stride(2), d ** -0.5, pointer(out),
                                      torch.get_num_threads())
        if rc == -2:
            raise MemoryError("celeris_dflash_stack could not allocate its scratch rows")
        if rc != 0:
            raise RuntimeError(f"celeris_dflash_stack failed ({rc}): a weight's shape its product does not take")
        return out
