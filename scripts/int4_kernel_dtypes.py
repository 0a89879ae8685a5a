"""Time PyTorch's CPU int4 kernel (``torch._weight_int4pack_mm_for_cpu``) at SmolLM2-135M's linear shapes with
bfloat16, float32 and float16 activations, beside a float32 ``F.linear``, at batch 1 (one row; the two-plane group-32
int8 layout of ``scripts/int8_floor.py`` passes ``[x, x]``, twice the input columns).

Each figure is the median over 5 passes of one call per weight on a ring of 30 random weights (so that they are not
cache-resident), in milliseconds per call. ``docs/quantization.md`` ("Group-32 int8 with wider activations") quotes it.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/int4_kernel_dtypes.py
"""

from __future__ import annotations

import statistics
import time

import torch

from celeris.models.quantize import int4_scales_and_zeros

SHAPES = [(960, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, gate_up, down (out x in)


def ring_ms(call, ring: list, passes: int = 5) -> float:  # noqa: ANN001 - a callable over one ring entry
    """Median over ``passes`` of the mean time of ``call(entry)`` over ``ring``, in milliseconds."""
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        for entry in ring:
            call(entry)
        times.append((time.perf_counter() - start) / len(ring) * 1e3)
    return statistics.median(times)


def packed(n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 8-bit codes as two int4 planes (2k columns), with group-32 scales and zeros in ``dtype``."""
    q = torch.randint(0, 256, (n, k), dtype=torch.int32)
    s, z = torch.rand(n, k // 32) * 0.01, torch.randn(n, k // 32) * 0.01
    weight = torch._convert_weight_to_int4pack_for_cpu(torch.cat([q >> 4, q & 15], 1).contiguous(), 1)
    return weight, int4_scales_and_zeros(torch.cat([16 * s, s], 1), torch.cat([z, torch.zeros_like(z)], 1), dtype)


@torch.no_grad()
def main() -> None:
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}")
    for n, k in SHAPES:
        row = [f"{n} x {k}"]
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            ring = [packed(n, k, dtype) for _ in range(30)]
            x = torch.randn(1, k).to(dtype)
            xx = torch.cat([x, x], 1)
            ms = ring_ms(lambda e, xx=xx: torch._weight_int4pack_mm_for_cpu(xx, e[0], 32, e[1]), ring)
            row.append(f"{str(dtype).removeprefix('torch.')} {ms:.3f}")
        weights, x = [torch.randn(n, k) for _ in range(30)], torch.randn(1, k)
        row.append(f"F.linear float32 {ring_ms(lambda w, x=x: torch.nn.functional.linear(x, w), weights):.3f}")
        print(" | ".join(row))


if __name__ == "__main__":
    main()
