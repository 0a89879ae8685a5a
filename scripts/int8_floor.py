"""Why ``--quantization int8`` misses issue 29's floor on SmolLM2-135M-Instruct: the error sources taken apart.

Measures, with ``celeris.bench.divergence.measure_divergence`` (teacher-forced top-1 agreement and mean KL against
float32 on float32's own greedy answers; the slow test's 8 chat questions, 32 tokens), SmolLM2 under variants that
each add one error source of the product's int8 path, applied to every ``nn.Linear`` of the transformer (the tied
head stays float32, as the product's default does):

- ``act_in_bf16``: float32 weights, each linear's input rounded to bfloat16;
- ``act_out_bf16``: float32 weights, each linear's output rounded to bfloat16 (the kernel returns bfloat16);
- ``act_inout_bf16``: both roundings;
- ``w8_f32``: int8 weights (per-channel absmax scales, float32 scales), float32 activations (dequantized weights in
  a plain float32 matmul: a diagnostic, never product code);
- ``w8_bf16scale``: the same with the scales rounded to bfloat16 (as the product stores them);
- ``w8mse_f32``: int8 weights whose per-channel scale is the MSE-optimal clipping found by a grid search;
- ``int8_emulated``: int8 weights, bfloat16 scales, input and output rounded to bfloat16 (the product's arithmetic);
- ``product_int8`` / ``product_int8_head``: ``LLM(..., quantization="int8")`` as shipped (head float32 / quantized);
- ``w8g32_sym`` / ``w8g32_asym``: int8 with one scale per group of 32 input columns (symmetric as llama.cpp's Q8_0;
  asymmetric ``w = lo + s * q``, q in [0, 255], which holds a Q4_1 block's 16 levels exactly since 255 = 15 * 17),
  float32 activations (dequantized weights, plain matmul: diagnostics);
- ``wfp8_f32`` / ``act_fp8`` / ``fp8_emulated``: ``--quantization fp8``'s two roundings apart: float8 e4m3
  weights per output channel (``fp8_rows``) with float32 activations; float32 weights with each linear's input
  rounded per token to e4m3 (``fp8_tokens``); both, with the output rounded to bfloat16 (the product's arithmetic;
  ``product_fp8`` runs the product's layers);
- ``kernel_int8_g32``: asymmetric group-32 int8 through PyTorch's int4 kernel at the product's bfloat16
  activations: the codes split into two nibble planes, ``q = 16 * hi + lo``, one ``_weight_int4pack_mm_for_cpu``
  call over ``[x, x]`` (2x the input columns) whose groups scale the high plane by ``16 s`` and the low one by ``s``
  (``GroupInt8Probe``; a prototype measured here, not product code).

``--sweep`` instead scores teacher-forced only (the same top-1 and KL as ``measure_divergence``, without the
free-running answers: faster) the absmax int8 weights with float32 activations in one part of the model at a time
(each linear kind, then each block), and column-scaled int8 (``w / c`` quantized per row, ``c`` = column absmax to
the power 0.25, 0.5, 1; activations float32).

``--awq`` scores (teacher-forced, as ``--sweep``) activation-aware int8 as AWQ (arXiv:2306.00978, eq. 4-5) scales
weights before rounding: ``w * s`` quantized per row and divided by ``s`` again, ``s`` = each input channel's mean
absolute activation to the power alpha, the activations recorded on calibration rows that are not the evaluated
questions (the first 16 training rows of ``train-data/dflash-smollm2.jsonl``: prompt and answer ids).

``--gptq`` scores (the same way) int8 per-channel weights rounded by GPTQ (arXiv:2210.17323, Algorithm 1, one
column at a time without lazy batches): each column's rounding error is spread over the columns not yet rounded
through the inverse Hessian ``H = X^T X`` of the layer's float inputs on the same calibration rows (dampened by 1% of
its mean diagonal); scales are each row's absmax, as the product's.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/int8_floor.py [variant ... | --sweep | --awq | --gptq]``
(``--mt-bench`` beside variants: the bench's quality set, 8 MT-Bench first turns x 64 tokens, instead;
``--times``: the group int8 kernel's time per call against per-channel int8 and float32, ``kernel_times``). Deterministic:
machine load changes the time taken, not the numbers.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from celeris.bench.divergence import CHAT_QUESTIONS as QUESTIONS
from celeris.bench.divergence import _kl_and_agreement, measure_divergence
from celeris.llm import LLM
from celeris.models.qlinear import fp8_rows, fp8_tokens
from celeris.models.quantize import int8_rows

ALIAS = "smollm2-135m-instruct"


class Probe(nn.Module):
    """A float32 linear with an optional rounding of its input (to bfloat16, or ``"fp8"``: per token to float8
    e4m3) and/or of its output (to bfloat16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, round_in: bool | str,
                 round_out: bool) -> None:
        super().__init__()
        self.weight, self.bias, self.round_in, self.round_out = weight, bias, round_in, round_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if self.round_in == "fp8":
            q, scale = fp8_tokens(h.reshape(-1, h.shape[-1]))
            h = (q.float() * scale).reshape(h.shape)
        elif self.round_in:
            h = h.bfloat16().float()
        y = F.linear(h, self.weight, self.bias)
        if self.round_out:
            y = y.bfloat16().float()
        return y.to(x.dtype)


def int8_mse_rows(w: torch.Tensor, grid: int = 40, low: float = 0.6) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 with the clipping ratio (of absmax, ``low``..1) that minimises each row's squared error."""
    amax = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)
    best_err = torch.full_like(amax, float("inf"))
    best_scale = amax / 127
    for r in torch.linspace(low, 1.0, grid):
        scale = amax * r / 127
        q = torch.round(w / scale[:, None]).clamp(-127, 127)
        err = ((q * scale[:, None] - w) ** 2).sum(1)
        better = err < best_err
        best_err, best_scale = torch.where(better, err, best_err), torch.where(better, scale, best_scale)
    return torch.round(w / best_scale[:, None]).clamp(-127, 127).to(torch.int8), best_scale


def int8_groups(w: torch.Tensor, group: int, asym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise int8 of w (out, in): codes q (out, in) int32, scale s and offset lo (out, in / group) float32 with
    ``w ~= lo + s * q`` per group (asym: q in [0, 255]; else lo = 0, q in [-128, 127], s = absmax / 127)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    if asym:
        lo = g.amin(-1)
        s = ((g.amax(-1) - lo) / 255).clamp(min=1e-8)
        return torch.round((g - lo[..., None]) / s[..., None]).clamp(0, 255).int().reshape(n, k), s, lo
    s = (g.abs().amax(-1) / 127).clamp(min=1e-8)
    return torch.round(g / s[..., None]).clamp(-128, 127).int().reshape(n, k), s, torch.zeros_like(s)


class GroupInt8Probe(nn.Module):
    """Asymmetric group-32 int8 through ``torch._weight_int4pack_mm_for_cpu`` (bfloat16 activations): planes
    ``hi = q >> 4`` and ``lo = q & 15`` side by side as 2 * in columns; the kernel reads ``(c - 8) * scale + zero``
    per group, so the high plane gets scale ``16 s`` and zero 0, the low one scale ``s`` and zero ``lo + 136 s``
    (split into its bfloat16 part and the rest over the two planes, so the sum keeps float32's precision)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int = 32) -> None:
        super().__init__()
        from celeris.models.quantize import int4_scales_and_zeros

        q, s, lo = int8_groups(weight, group, asym=True)
        zero = lo + 136 * s
        zero_hi = zero.bfloat16().float()
        self.group, self.bias = group, bias
        self.packed = torch._convert_weight_to_int4pack_for_cpu(torch.cat([q >> 4, q & 15], 1).contiguous(), 1)
        self.table = int4_scales_and_zeros(torch.cat([16 * s, s], 1), torch.cat([zero_hi, zero - zero_hi], 1),
                                           torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).bfloat16()
        y = torch._weight_int4pack_mm_for_cpu(torch.cat([flat, flat], 1), self.packed, self.group, self.table)
        y = y.reshape(*x.shape[:-1], -1).to(x.dtype)
        return y if self.bias is None else y + self.bias


def weight_of(w: torch.Tensor, kind: str) -> torch.Tensor:
    """The weight a variant computes with: float32, or int8 dequantized (``absmax``/``mse``, scale f32 or bf16)."""
    if kind == "f32":
        return w
    if kind == "fp8":
        q, scale = fp8_rows(w)
        return q.float() * scale[:, None]
    if kind.startswith("g32"):
        q, scale, lo = int8_groups(w, 32, asym=kind.endswith("asym"))
        return (lo[..., None] + scale[..., None] * q.float().reshape(*scale.shape, 32)).reshape(w.shape)
    q, scale = int8_mse_rows(w) if kind.startswith("mse") else int8_rows(w)
    if kind.endswith("bf16scale"):
        scale = scale.bfloat16().float()
    return q.float() * scale[:, None]


VARIANTS: dict[str, tuple[str, bool | str, bool]] = {  # name -> (weight kind, round input, round output)
    "fp32": ("f32", False, False),
    "act_in_bf16": ("f32", True, False),
    "act_out_bf16": ("f32", False, True),
    "act_inout_bf16": ("f32", True, True),
    "w8_f32": ("absmax", False, False),
    "w8_bf16scale": ("absmax_bf16scale", False, False),
    "w8mse_f32": ("mse", False, False),
    "int8_emulated": ("absmax_bf16scale", True, True),
    "w8g32_sym": ("g32_sym", False, False),
    "w8g32_asym": ("g32_asym", False, False),
    "kernel_int8_g32": ("group_int8_kernel", True, True),
    "wfp8_f32": ("fp8", False, False),
    "act_fp8": ("f32", "fp8", False),
    "fp8_emulated": ("fp8", "fp8", True),
}


def patch(model: nn.Module, kind: str, round_in: bool | str, round_out: bool) -> list[tuple[nn.Module, str, nn.Module]]:
    """Replace every ``nn.Linear`` of ``model`` by a ``Probe``; returns what to put back."""
    undo = []
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear) and name.split(".")[-1] != "lm_head":
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            w = m.weight.detach().float()
            probe = GroupInt8Probe(w, m.bias) if kind == "group_int8_kernel" else Probe(weight_of(w, kind), m.bias,
                                                                                        round_in, round_out)
            setattr(parent, name.rpartition(".")[2], probe)
            undo.append((parent, name.rpartition(".")[2], m))
    return undo


def column_scaled(w: torch.Tensor, alpha: float) -> torch.Tensor:
    """int8 rows of ``w / c`` (``c`` = each column's absmax ** alpha), dequantized and scaled back by ``c``."""
    c = w.abs().amax(0).clamp(min=1e-8) ** alpha
    q, scale = int8_rows(w / c)
    return q.float() * scale[:, None] * c


class Scorer:
    """Teacher-forced top-1 / KL of ``candidate`` (float32 activations) against ``reference`` on the reference's own
    greedy answers to ``prompts``, with some ``nn.Linear`` weights replaced for one measurement at a time."""

    @torch.no_grad()
    def __init__(self, reference: LLM, candidate: LLM, prompts: list[list[int]], params) -> None:  # noqa: ANN001
        self.model, self.prompts = candidate.model, prompts
        self.answers = [reference.generate([p], params)[0].token_ids for p in prompts]
        self.ref = [reference.model(torch.tensor([p + a]))[0, -len(a):] for p, a in zip(prompts, self.answers,
                                                                                         strict=True)]
        self.linears = {n: m for n, m in self.model.named_modules()
                        if isinstance(m, nn.Linear) and not n.endswith("lm_head")}
        if not self.linears:
            raise SystemExit("no nn.Linear layers to patch (oneDNN's prepacked layers replace them)")

    @torch.no_grad()
    def score(self, name: str, weight: Callable[[str, torch.Tensor], torch.Tensor | None]) -> None:
        """Print top-1, mean KL and flips with each linear ``n``'s float32 weight ``w`` replaced by ``weight(n, w)``
        (None: left as it is); the model is restored after."""
        undo = []
        for n, m in self.linears.items():
            new = weight(n, m.weight.detach().float())
            if new is not None:
                parent, attr = self.model.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]
                setattr(parent, attr, Probe(new, m.bias, False, False))
                undo.append((parent, attr, m))
        kls, same = [], []
        for (p, a), r in zip(zip(self.prompts, self.answers, strict=True), self.ref, strict=True):
            kl, agree = _kl_and_agreement(r, self.model(torch.tensor([p + a]))[0, -len(a):])
            kls.append(kl)
            same.append(agree)
        for parent, attr, m in undo:
            setattr(parent, attr, m)
        agree_all = torch.cat(same)
        print(f"{name:22s} tokens {agree_all.numel()} top1 {agree_all.float().mean():.4f} "
              f"kl {torch.cat(kls).mean():.6f} flips {int((~agree_all).sum())}", flush=True)


def sweep(scorer: Scorer) -> None:
    """int8 weights (float32 activations) in one part of the model at a time, then column-scaled int8 everywhere."""

    def only(chosen: Callable[[str], bool], weight: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
        return lambda n, w: weight(w) if chosen(n) else None

    absmax = lambda w: weight_of(w, "absmax")  # noqa: E731
    scorer.score("all linears", only(lambda n: True, absmax))
    for kind in sorted({n.rpartition(".")[2] for n in scorer.linears}):
        scorer.score(f"only {kind}", only(lambda n, kind=kind: n.endswith(kind), absmax))
    for i in range(len(scorer.model.layers)):
        scorer.score(f"only block {i}", only(lambda n, i=i: n.startswith(f"layers.{i}."), absmax))
    for alpha in (0.25, 0.5, 1.0):
        scorer.score(f"column-scaled a={alpha}", only(lambda n: True, lambda w, alpha=alpha: column_scaled(w, alpha)))


def input_stats(model: nn.Module, rows: list[list[int]],
                stat: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each linear's ``stat(x)`` summed over its (n, in_features) float64 inputs on ``rows``, divided by n."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and not name.endswith("lm_head"):
            def hook(_m, args, _out, name=name) -> None:  # noqa: ANN001
                x = args[0].detach().double().reshape(-1, args[0].shape[-1])
                sums[name] = sums.get(name, 0) + stat(x)
                counts[name] = counts.get(name, 0) + x.shape[0]
            hooks.append(m.register_forward_hook(hook))
    with torch.no_grad():
        for ids in rows:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return {n: sums[n] / counts[n] for n in sums}


def mean_abs(x: torch.Tensor) -> torch.Tensor:
    """Per input channel: sum of |x| (AWQ's activation magnitude once divided by n)."""
    return x.abs().sum(0)


def hessian(x: torch.Tensor) -> torch.Tensor:
    """``X^T X`` (GPTQ's layer Hessian once divided by n)."""
    return x.T @ x


def gptq_weight(w: torch.Tensor, hessian: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """int8 per-row weights (absmax scales) rounded column by column by GPTQ, dequantized (float32)."""
    w = w.double().clone()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)  # (out,)
    h = hessian.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.empty_like(w)
    for i in range(w.shape[1]):
        col = w[:, i]
        q[:, i] = torch.clamp(torch.round(col / scale), -127, 127) * scale
        err = (col - q[:, i]) / hinv[i, i]
        w[:, i + 1:] -= err[:, None] * hinv[i, i + 1:][None]
    return q.float()


def awq_weight(w: torch.Tensor, act: torch.Tensor, alpha: float) -> torch.Tensor:
    """int8 rows of ``w * s`` divided by ``s`` after dequantizing, ``s = act ** alpha`` normalised to mean 1."""
    s = act.clamp(min=1e-6) ** alpha
    s = s / s.mean()
    q, scale = int8_rows(w * s)
    return q.float() * scale[:, None] / s


def calibrated(scorer: Scorer, gptq: bool) -> None:
    """AWQ-scaled int8 weights for several alphas, or (``gptq``) GPTQ-rounded int8 weights, with statistics of 16
    training rows of ``train-data/dflash-smollm2.jsonl`` (not the evaluated questions)."""
    import json
    from pathlib import Path

    lines = Path("train-data/dflash-smollm2.jsonl").read_text().splitlines()[:16]
    rows = [json.loads(line)["ids"][:512] for line in lines]  # each row's prompt (chat template) and answer ids
    if gptq:
        h = input_stats(scorer.model, rows, hessian)
        scorer.score(f"gptq ({len(rows)} rows)", lambda n, w: gptq_weight(w, h[n]))
        return
    acts = {n: a.float() for n, a in input_stats(scorer.model, rows, mean_abs).items()}
    for alpha in (0.0, 0.25, 0.5, 0.75, 1.0):
        scorer.score(f"awq alpha={alpha} ({len(rows)} rows)", lambda n, w, alpha=alpha: awq_weight(w, acts[n], alpha))


def kernel_times(ring: int = 30, repeats: int = 100) -> None:
    """Milliseconds of one batch-1 call at SmolLM2's three linear shapes (medians over a ring of ``ring`` random
    weights, so that they are not cache-resident): the two-plane group int8 (``GroupInt8Probe``), per-channel int8
    (the product's ``Int8Linear``) and a float32 matmul."""
    import statistics

    from celeris.models.quantize import Int8Linear

    for out_features, in_features in ((960, 576), (3072, 576), (576, 1536)):
        layers = [nn.Linear(in_features, out_features, bias=False) for _ in range(ring)]
        kinds = {"group int8 (two planes)": [GroupInt8Probe(m.weight.detach(), None) for m in layers],
                 "per-channel int8": [Int8Linear(m, torch.bfloat16) for m in layers], "float32": layers}
        x = torch.randn(1, in_features)
        line = []
        for kind, mods in kinds.items():
            times = []
            with torch.no_grad():
                for i in range(repeats + ring):
                    start = time.perf_counter()
                    mods[i % ring](x)
                    times.append(time.perf_counter() - start)
            line.append(f"{kind} {1000 * statistics.median(times[ring:]):.3f}")
        print(f"{out_features}x{in_features}: " + ", ".join(line) + " ms", flush=True)


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    if names == ["--times"]:
        kernel_times()
        return
    reference = LLM(ALIAS, device="cpu", dtype="float32")
    questions, tokens = QUESTIONS, 32
    if "--mt-bench" in names:  # the bench's quality set instead: 8 MT-Bench first turns, 64 tokens
        from celeris.bench.chat import PROMPT_SETS

        names = [n for n in names if n != "--mt-bench"]
        questions, tokens = PROMPT_SETS["mt-bench"]()[:8], 64
    prompts = [reference.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    params = reference.default_params(max_tokens=tokens)
    candidate = LLM(ALIAS, device="cpu", dtype="float32", onednn=False)  # plain nn.Linear layers to patch
    if names == ["--sweep"]:
        sweep(Scorer(reference, candidate, prompts, params))
        return
    if names in (["--awq"], ["--gptq"]):
        calibrated(Scorer(reference, candidate, prompts, params), gptq=names == ["--gptq"])
        return
    for name in names or [*VARIANTS, "product_int8", "product_int8_head"]:
        t = time.perf_counter()
        if name.startswith("product_"):
            method = name.removeprefix("product_").removesuffix("_head")
            q = LLM(ALIAS, device="cpu", dtype="float32", quantization=method, quantize_lm_head=name.endswith("_head"))
            d = measure_divergence(reference, q, prompts, params)
        else:
            undo = patch(candidate.model, *VARIANTS[name])
            try:
                d = measure_divergence(reference, candidate, prompts, params)
            finally:
                for parent, attr, m in undo:
                    setattr(parent, attr, m)
        first = ", ".join("-" if f is None else str(f) for f in d.first_divergence)
        print(f"{name:18s} tokens {d.tokens} top1 {d.top1_agreement:.4f} kl {d.mean_kl:.6f} first [{first}] "
              f"({time.perf_counter() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
