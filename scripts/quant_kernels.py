"""Weight-only quantized matmul candidates on SmolLM2-135M's linear shapes (an indication, not a bench).

Times float32, bfloat16, ``torch._weight_int8pack_mm`` (int8 per output channel), ``torch._weight_int4pack_mm_for_cpu``
(group-wise int4) and ``torch._dyn_quant_matmul_4bit`` at batch 1 and 8 on one thread, each weight read from a ring of
copies bigger than the last-level cache (so every call streams its weight from memory, as a decoding pass does).
Run: ``OMP_NUM_THREADS=1 python scripts/quant_kernels.py``; on a shared machine the numbers are indications only.
"""

from __future__ import annotations

import time

import torch

SHAPES = {"q_proj": (576, 576), "k_proj": (192, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}  # (out N, in K)
RING_BYTES = 256 << 20


def bench(fn, ring: int, reps: int = 3) -> float:  # noqa: ANN001
    """Median ms per call over ``reps`` sweeps of ``ring`` calls (fn(i) uses weight copy i)."""
    fn(0)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(ring):
            fn(i)
        out.append((time.perf_counter() - t) / ring * 1e3)
    return sorted(out)[len(out) // 2]


def candidates(n: int, k: int, m: int) -> dict[str, float]:
    w = torch.randn(n, k) * 0.02
    ring = max(2, min(64, RING_BYTES // (n * k * 4)))
    x32, x16 = torch.randn(m, k), torch.randn(m, k).bfloat16()
    res = {}
    ws = [w.clone() for _ in range(ring)]
    res["float32"] = bench(lambda i: torch.nn.functional.linear(x32, ws[i]), ring)
    wb = [w.bfloat16() for _ in range(ring)]
    res["bfloat16"] = bench(lambda i: torch.nn.functional.linear(x16, wb[i]), ring)
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    q8 = [torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8) for _ in range(ring)]
    res["int8 _weight_int8pack_mm f32"] = bench(lambda i: torch._weight_int8pack_mm(x32, q8[i], scale), ring)
    res["int8 _weight_int8pack_mm bf16"] = bench(lambda i: torch._weight_int8pack_mm(x16, q8[i], scale.bfloat16()),
                                                 ring)
    g = 32 if k % 64 else 64
    wg = w.reshape(n, k // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    s = ((hi - lo) / 15).clamp(min=1e-8)
    q4 = torch.round((wg - lo[..., None]) / s[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    zeros = lo + 8 * s  # the kernel computes (q - 8) * scale + zero
    sz = torch.stack([s, zeros], -1).transpose(0, 1).contiguous()  # (K/g, N, 2)
    packed = [torch._convert_weight_to_int4pack_for_cpu(q4, 1) for _ in range(ring)]
    for name, x, szt in (("f32", x32, sz), ("bf16", x16, sz.bfloat16())):
        try:
            res[f"int4 _weight_int4pack_mm_for_cpu g{g} {name}"] = bench(
                lambda i, x=x, szt=szt: torch._weight_int4pack_mm_for_cpu(x, packed[i], g, szt), ring)
        except RuntimeError as exc:
            res[f"int4 _weight_int4pack_mm_for_cpu g{g} {name}"] = f"refused: {str(exc).splitlines()[0][:60]}"
    try:
        sym = (w.reshape(n, k // g, g).abs().amax(-1) / 7).clamp(min=1e-8)
        qs = (torch.round(w.reshape(n, k // g, g) / sym[..., None]).clamp(-8, 7) + 8).to(torch.uint8).reshape(n, k)
        pk = [torch._dyn_quant_pack_4bit_weight(qs, sym.float(), None, g, k, n) for _ in range(ring)]
        res[f"int4 _dyn_quant_matmul_4bit g{g}"] = bench(lambda i: torch._dyn_quant_matmul_4bit(x32, pk[i], g, k, n),
                                                        ring)
    except RuntimeError as exc:
        res[f"int4 _dyn_quant_matmul_4bit g{g}"] = f"refused: {str(exc).splitlines()[0][:60]}"
    return res


def main() -> None:
    torch.set_num_threads(1)
    for name, (n, k) in SHAPES.items():
        for m in (1, 8):
            for cand, ms in candidates(n, k, m).items():
                print(f"{name:8s} {n}x{k} batch {m}: {cand:42s} " + (f"{ms:7.3f} ms" if isinstance(ms, float) else ms),
                      flush=True)


if __name__ == "__main__":
    main()
