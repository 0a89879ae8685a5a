"""`celeris bench` on tiny checkpoints: every system runs, measures are consistent, files are written."""

from __future__ import annotations

import json

import torch

from celeris.bench.run import BenchConfig, agreement, format_table, run_bench
from celeris.models.celeris import CelerisModel
from celeris.models.loader import save_checkpoint
from tests.conftest import tiny_config


def write_prompts(path, n=3):
    lines = [json.dumps({"task_id": f"T/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x.\"\"\"\n"}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")


def test_agreement_is_positionwise_share_of_reference():
    assert agreement([[1, 2, 3], [4]], [[1, 9, 3], [4, 5]]) == 0.6
    assert agreement([[]], [[]]) == 0.0


def test_bench_runs_all_systems_and_writes_results(tiny_checkpoint, tokenizer_dir, tmp_path):
    torch.manual_seed(0)
    vocab = json.loads((tiny_checkpoint / "config.json").read_text())
    ar = CelerisModel(tiny_config(vocab_size=vocab["vocab_size"], eos_token_id=vocab["eos_token_id"],
                                  mask_token_id=vocab["mask_token_id"], pad_token_id=vocab["pad_token_id"],
                                  is_causal=True))
    ar.init_weights()
    ar_dir = tmp_path / "ar"
    save_checkpoint(ar, ar_dir, tokenizer_dir)
    prompts = tmp_path / "he.jsonl"
    write_prompts(prompts)
    cfg = BenchConfig(model=str(tiny_checkpoint), ar_model=str(ar_dir), lengths=[8, 16], batch_sizes=[1, 2],
                      num_prompts=3, warmup=1, prompts=str(prompts), out_dir=str(tmp_path / "out"))
    results = run_bench(cfg)
    runs = [r for r in results["runs"] if "system" in r]
    assert {r["system"] for r in runs} == {"dllm-reference", "dllm-fast", "ar-twin"}
    for r in runs:
        assert r["output_tokens"] <= 3 * r["max_new_tokens"] and r["tokens_per_s"] > 0
        assert r["latency_p50_s"] <= r["latency_p95_s"]
        assert 0 <= r["parse_rate"] <= 1 and 0 <= r["repetition_share"] <= 1
        assert r["output_tokens"] == 0 or r["judge_perplexity"] > 0
    reference = [r for r in runs if r["system"] == "dllm-reference"]
    assert all(r["agreement_with_reference"] == 1.0 for r in reference if r["output_tokens"])
    assert all(r["nfe_mean"] == r["max_new_tokens"] for r in reference)  # one token per step, no early exit
    on_disk = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert on_disk["conditions"]["config"]["batch_sizes"] == [1, 2] and on_disk["conditions"]["prompt_tokens"]["max"] > 0
    assert {(r["max_new_tokens"], r["batch_size"]) for r in runs} == {(8, 1), (8, 2), (16, 1), (16, 2)}
    for name in ("tokens_per_s.png", "tokens_per_s_by_batch.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert "dllm-fast" in format_table(results)
