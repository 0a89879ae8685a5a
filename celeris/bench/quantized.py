"""``celeris bench --quantization int8,int4,...``: the same checkpoint at other weight widths beside the unquantized
one, in one run (both benches: ``celeris.bench.run`` and ``celeris.bench.chat``).

Per width: a copy of the model loaded with ``quantization=`` (or ``dtype="bfloat16"`` for the pseudo-method
``bfloat16``), its systems run under the same conditions (their names get ``@width``), its pass cost by width
(``celeris.bench.run.pass_cost_ms``), its resident weight bytes and its quality against the unquantized model
(``celeris.bench.divergence.measure_divergence``: teacher-forced top-1 agreement, mean KL, first divergence),
with a warning line in the notes when a floor is missed.
"""

from __future__ import annotations

from collections.abc import Callable

from celeris.bench.divergence import floor_warning, measure_divergence
from celeris.config import QUANTIZATION_METHODS
from celeris.llm import LLM
from celeris.models.quantize import resident_weight_bytes
from celeris.sampling.params import SamplingParams

# what the bench's --quantization list may name ("none" is what float32 already is: a checkpoint's own weights)
BENCH_WIDTHS = ("bfloat16", *(m for m in QUANTIZATION_METHODS if m != "none"))
HEAD_SUFFIX = "+lm_head"  # a width with its head quantized too (--quantize-lm-head for that width alone)
COMPILE_SUFFIX = "+compile"  # a width whose model runs under torch.compile (--compile for that width alone)
COMPILED_BASELINE = "float32" + COMPILE_SUFFIX  # the unquantized model compiled, beside the eager one


def base_width(name: str) -> str:
    """The method of a bench width name: ``int4+lm_head+compile`` -> ``int4`` (``float32+compile``: ``float32``,
    the unquantized model; other names unchanged)."""
    return name.removesuffix(COMPILE_SUFFIX).removesuffix(HEAD_SUFFIX)


def has_head(name: str) -> bool:
    """Whether a bench width name quantizes its head too (``int4+lm_head``, ``int4+lm_head+compile``)."""
    return name.removesuffix(COMPILE_SUFFIX).endswith(HEAD_SUFFIX)


def parse_widths(text: str | None) -> list[str]:
    """The bench's ``--quantization`` list (comma-separated) as names: ``BENCH_WIDTHS``, an int8/int4 method
    with ``+lm_head`` (its head quantized too, beside the same method with a float head in one run), any of these
    with ``+compile`` last (its model under ``torch.compile``), and ``float32+compile`` (the unquantized model
    compiled, beside the eager baseline).

    Raises:
        ValueError: a name not in ``BENCH_WIDTHS`` (or ``+lm_head`` on bfloat16 or gguf), or a repeated one.
    """
    if not text:
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n != COMPILED_BASELINE and (
        base_width(n) not in BENCH_WIDTHS
        or (has_head(n) and base_width(n) in ("bfloat16", "gguf")))]
    if unknown:
        raise ValueError(f"--quantization: unknown width(s) {', '.join(unknown)}; the bench takes "
                         f"{', '.join(BENCH_WIDTHS)}, an int8/int4 method with {HEAD_SUFFIX}, any of them with "
                         f"{COMPILE_SUFFIX}, and {COMPILED_BASELINE}")
    if len(set(names)) != len(names):
        raise ValueError(f"--quantization names a width twice: {text}")
    return names


def load_width(width: str, load: Callable[..., LLM], quantize_lm_head: bool = False) -> LLM:
    """The checkpoint at ``width``: ``load(**options)`` with ``dtype="bfloat16"`` or ``quantization=width`` (its
    head quantized with ``quantize_lm_head`` or a ``+lm_head`` name), and ``enforce_eager=False`` for a
    ``+compile`` name (``float32+compile``: no other option)."""
    compiled = {"enforce_eager": False} if width.endswith(COMPILE_SUFFIX) else {}
    base = base_width(width)
    if base == "float32":  # "none": not a checkpoint's own CPU quantization (the code models' q8_0)
        return load(quantization="none", **compiled)
    if base == "bfloat16":
        return load(dtype="bfloat16", quantization="none", **compiled)
    head = quantize_lm_head or has_head(width)
    return load(quantization=base, quantize_lm_head=head, **compiled)


def width_report(reference: LLM, candidate: LLM, width: str, prompts: list[list[int]], params: SamplingParams,
                 pass_cost: Callable[[LLM], dict]) -> tuple[dict, str | None]:
    """Quality, pass cost and resident bytes of ``candidate`` (``width``) against ``reference``; the floor warning
    (None when met; bfloat16 and float32+compile are held to int8's floor). Quality is teacher-forced through the
    models' eager forward, compiled widths included; their pass cost goes through the engine's compiled entries."""
    divergence = measure_divergence(reference, candidate, prompts, params)
    report = {"width": width, "quality": divergence.to_json(), "pass_cost_ms_by_width": pass_cost(candidate),
              "resident_weight_bytes": resident_weight_bytes(candidate.model),
              "reference_resident_weight_bytes": resident_weight_bytes(reference.model),
              "quality_conditions": "teacher-forced on the unquantized model's greedy answers "
                                    f"(max_tokens {params.max_tokens}, decoding {params.decoding}, "
                                    f"{len(prompts)} prompts)"}
    warning = floor_warning(width, divergence, "int8" if base_width(width) in ("bfloat16", "float32") else None)
    report["floor_met"] = warning is None
    return report, warning


SPEED_FLOOR = 1.8  # int8 or int4 at its quality floor against the eager float32 model, batch 1, in the same run


def speed_floor(runs: list[dict], reports: dict[str, dict], baseline: str = "target-next-token") -> str | None:
    """Each int8/int4 width's batch-1 speed-up over the unquantized model, stored in its report as
    ``speedup_batch1`` (its ``f"{baseline}@{width}"`` runs' tokens/s over ``baseline``'s, each averaged over the
    prompt sets run at batch 1); returns the warning line when no width at its quality floor (``floor_met``)
    reaches ``SPEED_FLOOR``, else None. None too when the run has no int8/int4 width or no batch-1 runs."""

    def tokens_per_s(system: str) -> float | None:
        found = [r["tokens_per_s"] for r in runs if r.get("system") == system and r.get("batch_size") == 1
                 and r.get("tokens_per_s")]
        return sum(found) / len(found) if found else None

    base = tokens_per_s(baseline)
    quantized = [w for w in reports if base_width(w) in QUANTIZATION_METHODS and base_width(w) != "gguf"]
    if base is None or not quantized:
        return None
    best = None
    for width in quantized:
        speed = tokens_per_s(f"{baseline}@{width}")
        if speed is None:
            continue
        reports[width]["speedup_batch1"] = round(speed / base, 3)
        if reports[width].get("floor_met") and (best is None or speed / base > best[1]):
            best = (width, speed / base)
    if best is not None and best[1] >= SPEED_FLOOR:
        return None
    held = f"the fastest at its quality floor is {best[0]} at {best[1]:.2f}x" if best else "none meets its quality floor"
    return (f"warning: no int8/int4 width reaches {SPEED_FLOOR}x float32's batch-1 tokens/s ({base:.2f}); {held}")
