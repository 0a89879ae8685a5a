"""One short accelerator check: engine correctness on the device, then per-step latency, tokens/s and peak
memory of the shipped model and of a randomly initialised model with LLaDA-8B's shape in bfloat16.

    python -m celeris.bench.gpu                      # on a CUDA machine; prints one JSON object per line
    python -m celeris.bench.gpu --device cpu --smoke # the same code on CPU with small shapes (CI-sized)

1. Correctness: a tiny random model on the device gives, at temperature 0, the reference sampler's tokens
   through the engine (batched, every cache mode), and its logits match the CPU's within float tolerance.
2. The shipped model: tokens/s of the reference settings (one token per step, no cache) and of the
   model's defaults on HumanEval prompts (``celeris bench``'s timing: submit to full answer).
3. LLaDA-8B's shape (arXiv:2502.09992: 32 layers, d_model 4096, 32 heads, SwiGLU 12288, vocabulary
   126,464), random weights, bfloat16: latency of one full pass and of one dual-cache window pass at batch
   1 and 8 over a 512-token canvas, tokens/s of a 256-token answer at the fast settings, peak memory.
4. Block diffusion: a tiny random SDAR model on the device gives the reference block sampler's tokens through
   the engine's block path (batched); then SDAR-1.7B's shape (arXiv:2510.06303 / JetLM/SDAR-1.7B-Chat
   config: 28 layers, hidden 2048, 16 query / 8 K/V heads of 128, q/k norms, SwiGLU 6144, vocabulary
   151,936), random weights, bfloat16: latency of one engine step (every row's 4-token block against the KV
   cache of its history) and of the reference's full recompute over the same canvas, tokens/s of a 256-token
   answer at the contract's defaults (block 4, ``low_confidence_dynamic`` 0.9), at batch 1 and 8, peak memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import torch

from celeris.config import EngineConfig
from celeris.engine import Engine
from celeris.models.llada import LLaDAConfig, LLaDAModel
from celeris.models.sdar import SDARConfig, SDARModel
from celeris.reference.masked import generate
from celeris.sampling.params import SamplingParams


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def open_device(name: str, prog: str) -> torch.device | None:
    """The device a check runs on, its first JSON line printed (torch's version, the device's name); None, with one
    error line naming ``prog``, when CUDA is asked for and there is none."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{prog}: error: no CUDA device (use --device cpu --smoke for a CPU run)", file=sys.stderr)
        return None
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(device)
                      if device.type == "cuda" else "cpu"}), flush=True)
    return device


def peak_memory_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def llada_shape(smoke: bool) -> LLaDAConfig:
    """LLaDA-8B's published config (``smoke``: the same layout, small)."""
    big = dict(d_model=4096, n_heads=32, n_kv_heads=32, n_layers=32, mlp_hidden_size=12288, vocab_size=126464)
    small = dict(d_model=128, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=256, vocab_size=1024)
    dims = small if smoke else big
    # smoke: a 512-token context (its canvases hold 64): the engine's KV store has a row of the whole context per
    # request, and 4096 zeroed columns would cost more than the smoke run's passes
    return LLaDAConfig(**dims, block_type="llama", layer_norm_type="rms", activation_type="silu", rope=True,
                       rope_theta=500000.0, weight_tying=False, max_sequence_length=512 if smoke else 4096,
                       mask_token_id=dims["vocab_size"] - 128, eos_token_id=dims["vocab_size"] - 383,
                       pad_token_id=dims["vocab_size"] - 383)


def engine_equals(model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams,
                  reference_ids: torch.Tensor) -> bool:
    """Whether the engine's answers to ``prompts`` equal the reference sampler's (B, L) ``reference_ids``."""
    engine = Engine(model, EngineConfig(max_num_seqs=8))
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return all(torch.equal(r.answer, reference_ids[i].cpu()) for i, r in enumerate(requests))


def check_correctness(device: torch.device) -> dict:
    """Engine == reference sampler on the device for every cache mode; device logits == CPU logits."""
    from celeris.models.celeris import CelerisConfig, CelerisModel

    torch.manual_seed(0)
    cpu_model = CelerisModel(CelerisConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4,
                                           intermediate_size=128, max_position_embeddings=128)).eval()
    cpu_model.init_weights(0.2)
    model = CelerisModel(cpu_model.config).to(device).eval()
    model.load_state_dict(cpu_model.state_dict())
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    ids = torch.tensor([prompts[0] + [1] * 8])
    with torch.no_grad():
        diff = (model(ids.to(device)).cpu() - cpu_model(ids)).abs().max().item()
    out = {"check": "correctness", "device": str(device), "max_logit_diff_vs_cpu": diff, "cache_modes": {}}
    for cache in ("none", "prefix", "dual", "delayed", "dual_delayed"):
        params = SamplingParams(max_tokens=16, steps=16, block_length=4, cache=cache, early_exit=False)
        out["cache_modes"][cache] = engine_equals(model, prompts, params, generate(model, prompts, params).answer_ids)
    out["ok"] = diff < 1e-3 and all(out["cache_modes"].values())
    return out


@torch.no_grad()
def time_call(fn, device: torch.device, repeats: int = 5) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def llada_shape_speed(device: torch.device, smoke: bool) -> list[dict]:
    """Full-pass and dual-cache window latency, then tokens/s of a 256-token answer, at batch 1 and 8."""
    from celeris.models.layers import KVCache

    cfg = llada_shape(smoke)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = LLaDAModel(cfg).to(dtype).eval()
    for p in model.parameters():
        p.data.normal_(0.0, 0.02)
    results = []
    answer = 32 if smoke else 256
    for batch in (1, 8):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        ids = torch.randint(0, cfg.vocab_size - 512, (batch, 2 * answer), device=device)
        cache = KVCache()
        span = (answer, answer + 32)  # the first 32-token block of the answer

        def full_pass(ids=ids, cache=cache, span=span):
            return model(ids, cache=cache, logits_slice=slice(*span))

        def window_pass(ids=ids, cache=cache, span=span):
            return model(ids, cache=cache, window=span)

        full_s, window_s = time_call(full_pass, device), time_call(window_pass, device)
        params = SamplingParams(max_tokens=answer, steps=answer, block_length=32, cache="dual",
                                decoding="threshold", threshold=0.9)
        run = timed_engine_run(model, ids[:, :answer].tolist(), params, batch, device, cfg.eos_token_id)
        results.append({"check": "llada-8b-shape", "dtype": str(dtype).removeprefix("torch."), "batch": batch,
                        "canvas_tokens": 2 * answer, "full_pass_ms": round(full_s * 1e3, 2),
                        "dual_window_pass_ms": round(window_s * 1e3, 2), **run,
                        "peak_memory_gb": peak_memory_gb(device)})
    return results


def timed_engine_run(model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams, batch: int,
                     device: torch.device, eos_id: int, config: EngineConfig | None = None) -> dict:
    """Decode ``prompts`` through a fresh ``Engine`` (``batch`` rows at a time; ``config``'s other settings),
    timed between device syncs: answer tokens (up to the first end id), seconds, tokens/s, the first engine step's
    seconds (the prefill pass with it: a slow prefill kernel shows there, not in the per-step passes) and the largest
    per-request NFE."""
    engine = Engine(model, replace(config or EngineConfig(), max_num_seqs=batch))
    sync(device)
    start = time.perf_counter()
    requests = [engine.add_request(p, params) for p in prompts]
    first_step = None
    while engine.has_unfinished():
        engine.step()
        if first_step is None:
            sync(device)
            first_step = time.perf_counter() - start
    sync(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.final_prefix(eos_id)) for r in requests)
    return {"answer_tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
            "first_step_s": round(first_step or 0.0, 4), "nfe": max(r.nfe for r in requests)}


def sdar_shape(smoke: bool) -> SDARConfig:
    """SDAR-1.7B-Chat's published config (``smoke``: the same layout, small)."""
    big = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_hidden_layers=28,
               intermediate_size=6144, vocab_size=151936)
    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                 intermediate_size=128, vocab_size=512)
    dims = small if smoke else big
    context = 512 if smoke else 32768  # smoke: as llada_shape's (the KV store's rows are the context long)
    return SDARConfig(**dims, max_position_embeddings=context, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, mask_token_id=dims["vocab_size"] - 1,
                      eos_token_id=dims["vocab_size"] - 3, pad_token_id=dims["vocab_size"] - 3)


def random_model(cfg: SDARConfig, device: torch.device, dtype: torch.dtype, std: float) -> SDARModel:
    torch.manual_seed(0)
    with torch.device(device):
        model = SDARModel(cfg).to(dtype).eval()
    for name, p in model.named_parameters():
        if "norm" not in name:
            p.data.normal_(0.0, std)
    return model


def check_block_correctness(device: torch.device) -> dict:
    """The engine's block path == the reference block sampler on the device (batched, mixed prompt lengths)."""
    from celeris.reference.block import generate_block

    model = random_model(sdar_shape(True), device, torch.float32, 0.2)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22]]
    out = {"check": "block-correctness", "device": str(device), "decoding": {}}
    for decoding in ("fixed", "low_confidence_dynamic", "threshold"):
        params = SamplingParams(max_tokens=16, steps=4, block_length=4, decoding=decoding, early_exit=False)
        reference = generate_block(model, prompts, params).answer_ids
        out["decoding"][decoding] = engine_equals(model, prompts, params, reference)
    out["ok"] = all(out["decoding"].values())
    return out


def sdar_shape_speed(device: torch.device, smoke: bool) -> list[dict]:
    """One engine step and one reference recompute, then tokens/s of a 256-token answer, at batch 1 and 8."""
    from celeris.models.contract import layout_mask

    cfg = sdar_shape(smoke)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(cfg, device, dtype, 0.02)
    answer = 32 if smoke else 256
    params = SamplingParams(**model.block_contract.defaults | {"max_tokens": answer})
    results = []
    for batch in (1, 8):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        prompts = torch.randint(0, cfg.vocab_size - 8, (batch, answer)).tolist()
        canvas = torch.randint(0, cfg.vocab_size - 8, (batch, 2 * answer), device=device)
        cols = torch.arange(2 * answer, device=device)[None].expand(batch, -1)
        end = torch.full((batch,), 2 * answer, device=device)
        mask = layout_mask(cols, 2 * answer, end - 4, end, torch.zeros_like(end), 4, "block_causal")
        recompute_s = time_call(lambda canvas=canvas, mask=mask: model.hidden_states(canvas, layout_mask=mask), device)
        engine = Engine(model, EngineConfig(max_num_seqs=batch))
        for p in prompts:
            engine.add_request(p, params)
        engine.step()  # the prefill pass (prompt + first block)
        step_s = time_call(engine.step, device, repeats=3)
        while engine.has_unfinished():
            engine.step()
        run = timed_engine_run(model, prompts, params, batch, device, cfg.eos_token_id)
        results.append({"check": "sdar-1.7b-shape", "dtype": str(dtype).removeprefix("torch."), "batch": batch,
                        "canvas_tokens": 2 * answer, "engine_step_ms": round(step_s * 1e3, 2),
                        "reference_recompute_ms": round(recompute_s * 1e3, 2), **run,
                        "peak_memory_gb": peak_memory_gb(device)})
    return results


def shipped_model_speed(out_dir: str) -> list[dict]:
    """The embedded model through ``celeris bench`` (on CUDA when available) at 256 tokens, batch 1 and 8."""
    from celeris.bench.run import BenchConfig, run_bench

    cfg = BenchConfig(lengths=[256], batch_sizes=[1, 8], num_prompts=8, warmup=1, out_dir=out_dir, smollm2=False)
    runs = run_bench(cfg)["runs"]
    return [{"check": "shipped-model", **{k: r.get(k) for k in ("system", "max_tokens", "batch_size",
                                                                 "tokens_per_s", "latency_p50_s", "nfe_mean",
                                                                 "peak_rss_mb")}} for r in runs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m celeris.bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="small shapes, no shipped-model bench (a CPU run)")
    p.add_argument("--out", default="bench-gpu", help="folder for the shipped model's bench.json")
    p.add_argument("--no-shipped", action="store_true", help="skip the shipped model's bench (its weights are not "
                   "on the device)")
    args = p.parse_args(argv)
    device = open_device(args.device, "gpu")
    if device is None:
        return 2
    correctness = check_correctness(device)
    print(json.dumps(correctness), flush=True)
    for row in llada_shape_speed(device, args.smoke):
        print(json.dumps(row), flush=True)
    block = check_block_correctness(device)
    print(json.dumps(block), flush=True)
    for row in sdar_shape_speed(device, args.smoke):
        print(json.dumps(row), flush=True)
    if not args.smoke and not args.no_shipped:
        for row in shipped_model_speed(args.out):
            print(json.dumps(row), flush=True)
    return 0 if correctness["ok"] and block["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
