"""The chat bench: its quality measures against plain definitions, and one tiny run end to end (a tiny causal
target with a tiny drafter): every system, resumed from its JSON, lossless against the target's own tokens."""

from __future__ import annotations

import json

import torch

from celeris.bench.chat import ChatBenchConfig, distinct_2, run_chat_bench


def test_distinct_2_counts_distinct_bigrams_over_all():
    assert distinct_2([[1, 2, 3, 1, 2]]) == 0.75  # (1,2) (2,3) (3,1) (1,2): 3 distinct of 4
    assert distinct_2([[5, 5, 5, 5]]) == round(1 / 3, 4)
    assert distinct_2([[1], []]) == 0.0


def test_a_tiny_chat_bench_runs_every_system_resumes_and_finds_no_mismatch(tiny_checkpoint, tokenizer_dir, tmp_path,
                                                                          monkeypatch):
    import celeris.bench.chat
    from celeris.models.dflash import save_dflash
    from celeris.models.loader import save_checkpoint
    from celeris.train.loop import AR_GENERATION
    from tests.conftest import TINY, tiny_model
    from tests.sampling.test_drafter import drafter_for

    config = json.loads((tiny_checkpoint / "config.json").read_text())
    special = {k: config[k] for k in ("vocab_size", "eos_token_id", "mask_token_id", "pad_token_id")}
    target = tiny_model(seed=1, **{**{k: config[k] for k in TINY if k in config}, **special, "is_causal": True})
    save_checkpoint(target, tmp_path / "target", tokenizer_dir, AR_GENERATION)
    save_dflash(drafter_for(target), tmp_path / "drafter", dtype=torch.float32)
    monkeypatch.setitem(celeris.bench.chat.PROMPT_SETS, "mt-bench", lambda: ["a b", "c d e", "f"])
    spec = json.dumps({"model": str(tmp_path / "drafter"), "num_speculative_tokens": 3, "disable_by_batch_size": 2,
                       "lookup_disable_by_batch_size": 2})
    cfg = ChatBenchConfig(model=str(tmp_path / "target"), prompt_sets=["mt-bench"], max_tokens=8, batch_sizes=[1, 2],
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
