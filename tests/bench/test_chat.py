"""The chat bench: its quality measures against plain definitions, and one tiny run end to end (a tiny causal
target with a tiny drafter): every system, resumed from its JSON, lossless against the target's own tokens."""

from __future__ import annotations

import json

import torch

from celeris.bench.chat import ChatBenchConfig, distinct_2, run_chat_bench


def save_tiny_causal_target(tiny_checkpoint, tokenizer_dir, folder):  # noqa: ANN001, ANN201 - test helper
    """A tiny causal target with the tiny checkpoint's vocabulary and special ids, saved to ``folder``; returns it."""
    from celeris.models.loader import save_checkpoint
    from celeris.train.loop import AR_GENERATION
    from tests.conftest import TINY, tiny_model

    config = json.loads((tiny_checkpoint / "config.json").read_text())
    special = {k: config[k] for k in ("vocab_size", "eos_token_id", "mask_token_id", "pad_token_id")}
    target = tiny_model(seed=1, **{**{k: config[k] for k in TINY if k in config}, **special, "is_causal": True})
    save_checkpoint(target, folder, tokenizer_dir, AR_GENERATION)
    return target


def test_distinct_2_counts_distinct_bigrams_over_all():
    assert distinct_2([[1, 2, 3, 1, 2]]) == 0.75  # (1,2) (2,3) (3,1) (1,2): 3 distinct of 4
    assert distinct_2([[5, 5, 5, 5]]) == round(1 / 3, 4)
    assert distinct_2([[1], []]) == 0.0


def test_a_tiny_chat_bench_runs_every_system_resumes_and_finds_no_mismatch(tiny_checkpoint, tokenizer_dir, tmp_path,
                                                                          monkeypatch):
    import celeris.bench.chat
    from celeris.models.dflash import save_dflash
    from tests.sampling.test_drafter import drafter_for

    target = save_tiny_causal_target(tiny_checkpoint, tokenizer_dir, tmp_path / "target")
    save_dflash(drafter_for(target), tmp_path / "drafter", dtype=torch.float32)
    monkeypatch.setitem(celeris.bench.chat.PROMPT_SETS, "mt-bench", lambda: ["a b", "c d e", "f"])
    spec = json.dumps({"model": str(tmp_path / "drafter"), "num_speculative_tokens": 3, "disable_by_batch_size": 2,
                       "lookup_disable_by_batch_size": 2})
    cfg = ChatBenchConfig(
        own_process_memory=False, model=str(tmp_path / "target"), prompt_sets=["mt-bench"], max_tokens=8, batch_sizes=[1, 2],
                          num_prompts=3, warmup=0, out_dir=str(tmp_path / "out"), smollm2=False,
                          speculative_config=spec)
    results = run_chat_bench(cfg)
    systems = [(r["system"], r["batch_size"]) for r in results["runs"]]
    names = ["target-next-token", "target-lookup", "dflash", "dflash-lookup-first", "default"]
    assert systems == [(n, b) for b in (1, 2) for n in names]
    for r in results["runs"]:
        assert r["output_tokens"] > 0 and r.get("mismatches", []) == []  # greedy: every system's text is the target's
    by = {(r["system"], r["batch_size"]): r for r in results["runs"]}
    assert by[("dflash", 1)]["drafter_passes"] > 0 and by[("target-lookup", 1)]["drafter_passes"] == 0
    # disable_by_batch_size 2: a pass with two rows running skips the drafter (a row left alone drafts again)
    assert by[("default", 1)]["drafter_passes"] == by[("dflash", 1)]["drafter_passes"]
    assert by[("default", 2)]["drafter_passes"] < by[("dflash", 2)]["drafter_passes"]
    assert set(results["pass_cost_ms_by_width"]) == {"batch 1", "batch 8"}
    again = run_chat_bench(cfg)  # everything is there already: nothing runs again
    assert [r["seconds"] for r in again["runs"]] == [r["seconds"] for r in results["runs"]]


def test_add_round_keeps_the_median_and_counts_rounds_whose_answers_differ():
    from celeris.bench.chat import add_round

    run = {"tokens_per_s": 10.0, "tokens_per_s_rounds": [10.0], "outputs": [[1, 2]]}
    add_round(run, {"tokens_per_s": 30.0, "outputs": [[1, 2]]})
    assert run["tokens_per_s"] == 20.0 and run["unstable_rounds"] == 0
    add_round(run, {"tokens_per_s": 12.0, "outputs": [[1, 3]]})
    assert run["tokens_per_s_rounds"] == [10.0, 30.0, 12.0] and run["tokens_per_s"] == 12.0
    assert run["unstable_rounds"] == 1 and run["outputs"] == [[1, 2]]  # the first round's answers stay


def test_rounds_rerun_every_system_in_a_rotated_order_and_resume(tiny_checkpoint, tokenizer_dir, tmp_path,
                                                                 monkeypatch):
    import statistics

    import celeris.bench.chat

    save_tiny_causal_target(tiny_checkpoint, tokenizer_dir, tmp_path / "target")
    monkeypatch.setitem(celeris.bench.chat.PROMPT_SETS, "mt-bench", lambda: ["a b", "c d e"])
    order = []
    real = celeris.bench.chat.run_one
    monkeypatch.setattr(celeris.bench.chat, "run_one", lambda *a: order.append(a[2]) or real(*a))
    cfg = ChatBenchConfig(
        own_process_memory=False, model=str(tmp_path / "target"), prompt_sets=["mt-bench"], max_tokens=6, batch_sizes=[1],
                          num_prompts=2, warmup=0, out_dir=str(tmp_path / "out"), smollm2=False, llamacpp=False,
                          rounds=3)
    results = run_chat_bench(cfg)
    names = ["target-next-token", "target-lookup"]
    assert order == names + names[1:] + names[:1] + names  # round 2 starts with the second system
    for r in results["runs"]:
        assert len(r["tokens_per_s_rounds"]) == 3 and r["unstable_rounds"] == 0
        assert r["tokens_per_s"] == round(statistics.median(r["tokens_per_s_rounds"]), 2)
    order.clear()
    assert run_chat_bench(cfg)["runs"] == results["runs"] and order == []  # all rounds there: nothing runs again
