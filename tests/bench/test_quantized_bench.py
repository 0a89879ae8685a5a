"""`celeris bench --quantization ...`: the systems at each width beside the model, with quality, pass cost and
resident bytes per width, and a warning line for each missed floor (celeris.bench.quantized)."""

from __future__ import annotations

import json

import pytest
import torch

from celeris.bench.chat import ChatBenchConfig, run_chat_bench
from celeris.bench.quantized import parse_widths
from celeris.bench.run import BenchConfig, run_bench
from tests.bench.test_run import write_prompts


def test_width_lists_are_checked():
    assert parse_widths("bfloat16, int8,int4") == ["bfloat16", "int8", "int4"]
    assert parse_widths("int4,int4+lm_head") == ["int4", "int4+lm_head"]
    assert parse_widths("float32+compile,int4+lm_head+compile,gguf+compile") == [
        "float32+compile", "int4+lm_head+compile", "gguf+compile"]
    for bad in ("int8,fp3", "gguf+lm_head", "bfloat16+lm_head", "fp3+lm_head", "float32", "int4+compile+lm_head",
                "float32+lm_head+compile", "bfloat16+lm_head+compile"):
        with pytest.raises(ValueError, match="unknown width"):
            parse_widths(bad)
    with pytest.raises(ValueError, match="twice"):
        BenchConfig(quantization="int8,int8")


def test_a_width_with_its_head_loads_the_method_with_the_head_quantized():
    from celeris.bench.quantized import load_width

    calls = []
    load = lambda **options: calls.append(options)  # noqa: E731
    for width in ("int4", "int4+lm_head", "bfloat16", "int4+lm_head+compile", "float32+compile"):
        load_width(width, load)
    assert calls == [{"quantization": "int4", "quantize_lm_head": False},
                     {"quantization": "int4", "quantize_lm_head": True},
                     {"dtype": "bfloat16", "quantization": "none"},  # float widths: no checkpoint's CPU default
                     {"quantization": "int4", "quantize_lm_head": True, "enforce_eager": False},
                     {"quantization": "none", "enforce_eager": False}]


def check_widths(results: dict, widths: list[str]) -> None:
    for w in widths:
        r = results["widths"][w]
        q = r["quality"]
        assert q["tokens"] > 0 and 0 <= q["top1_agreement"] <= 1 and q["mean_kl"] >= 0
        assert r["resident_weight_bytes"] < r["reference_resident_weight_bytes"]
        assert r["pass_cost_ms_by_width"]
        warned = any(n.startswith(f"warning: {w} misses") for n in results["notes"])
        assert warned == (not r["floor_met"])


def test_the_humaneval_bench_runs_each_width_beside_the_model(tiny_checkpoint, tmp_path):
    prompts = tmp_path / "he.jsonl"
    write_prompts(prompts, n=2)
    cfg = BenchConfig(model=str(tiny_checkpoint), ar_model=None, lengths=[8], num_prompts=2, warmup=0,
                      prompts=str(prompts), out_dir=str(tmp_path / "out"), smollm2=False,
                      quantization="bfloat16,int8,int4")
    results = run_bench(cfg)
    systems = [r["system"] for r in results["runs"]]
    assert systems == ["dllm-reference", "dllm-fast"] + [f"dllm-{s}@{w}" for w in ("bfloat16", "int8", "int4")
                                                         for s in ("reference", "fast")]
    check_widths(results, ["bfloat16", "int8", "int4"])
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["widths"]["int8"]["floor_met"] in (True, False)


def test_the_chat_bench_quantizes_the_drafter_too(tiny_checkpoint, tokenizer_dir, tmp_path, monkeypatch):
    import celeris.bench.chat
    from celeris.models.dflash import save_dflash
    from celeris.models.loader import save_checkpoint
    from celeris.models.quantize import QuantizedLinear
    from celeris.train.loop import AR_GENERATION
    from tests.conftest import TINY, tiny_model
    from tests.sampling.test_drafter import drafter_for

    config = json.loads((tiny_checkpoint / "config.json").read_text())
    special = {k: config[k] for k in ("vocab_size", "eos_token_id", "mask_token_id", "pad_token_id")}
    target = tiny_model(seed=1, **{**{k: config[k] for k in TINY if k in config}, **special, "is_causal": True})
    save_checkpoint(target, tmp_path / "target", tokenizer_dir, AR_GENERATION)
    save_dflash(drafter_for(target), tmp_path / "drafter", dtype=torch.float32)
    monkeypatch.setitem(celeris.bench.chat.PROMPT_SETS, "mt-bench", lambda: ["a b", "c d e"])
    spec = json.dumps({"model": str(tmp_path / "drafter"), "num_speculative_tokens": 3})
    cfg = ChatBenchConfig(
        own_process_memory=False, model=str(tmp_path / "target"), prompt_sets=["mt-bench"], max_tokens=8, batch_sizes=[1],
                          num_prompts=2, warmup=0, out_dir=str(tmp_path / "out"), smollm2=False,
                          speculative_config=spec, quantization="int8", quality_prompts=2)
    seen = []
    real = celeris.bench.chat.run_one

    def spy(owner, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        if owner.proposer is not None and owner.engine_config.quantization:
            seen.append(all(isinstance(m, QuantizedLinear) for n, m in owner.proposer.drafter.named_modules()
                            if n.endswith(("proj", "fc"))))
        return real(owner, *args, **kwargs)

    monkeypatch.setattr(celeris.bench.chat, "run_one", spy)
    results = run_chat_bench(cfg)
    systems = [r["system"] for r in results["runs"]]
    assert systems == ["target-next-token", "target-lookup", "dflash", "dflash-lookup-first",
                       "target-next-token@int8", "dflash@int8", "dflash-lookup-first@int8"]
    assert seen and all(seen)
    check_widths(results, ["int8"])
    assert set(results["widths"]["int8"]["pass_cost_ms_by_width"]) == {"batch 1", "batch 8"}


def test_the_speed_floor_counts_only_int8_or_int4_widths_at_their_quality_floor():
    """``speed_floor``: each int8/int4 width's batch-1 tokens/s over float32's (averaged over prompt sets) goes in
    its report; the warning names the fastest width at its quality floor, and is None once one reaches 1.8x."""
    from celeris.bench.quantized import SPEED_FLOOR, speed_floor

    def run(system, tps, batch=1, prompt_set="mt-bench"):  # noqa: ANN001, ANN202
        return {"system": system, "tokens_per_s": tps, "batch_size": batch, "prompt_set": prompt_set}

    runs = [run("target-next-token", 10.0), run("target-next-token", 20.0, prompt_set="gsm8k"),
            run("target-next-token@int8", 40.0), run("target-next-token@int8", 40.0, prompt_set="gsm8k"),
            run("target-next-token@int4+lm_head+compile", 25.0), run("target-next-token@int4", 99.0, batch=8),
            run("target-next-token@bfloat16", 90.0), run("target-next-token@gguf", 90.0)]
    reports = {"int8": {"floor_met": False}, "int4+lm_head+compile": {"floor_met": True}, "int4": {"floor_met": True},
               "bfloat16": {"floor_met": True}, "gguf": {"floor_met": True}}
    warning = speed_floor(runs, reports)
    assert reports["int8"]["speedup_batch1"] == round(40 / 15, 3)  # measured, though its quality misses the floor
    assert reports["int4+lm_head+compile"]["speedup_batch1"] == round(25 / 15, 3)
    assert "speedup_batch1" not in reports["int4"] and "speedup_batch1" not in reports["bfloat16"]
    assert warning is not None and "int4+lm_head+compile at 1.67x" in warning and "(15.00)" in warning
    runs.append(run("target-next-token@int4+lm_head+compile", 2 * SPEED_FLOOR * 15.0 - 25.0, prompt_set="gsm8k"))
    assert speed_floor(runs, reports) is None  # the mean of 25 and 29 over 15: 1.8x
    assert speed_floor(runs, {"bfloat16": {"floor_met": True}}) is None  # nothing int8/int4 to hold to it
