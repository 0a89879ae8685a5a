"""`celeris train --objective dflash` end to end on a tiny transformers target: it trains, checkpoints, measures
the acceptance curve, resumes, and exports a drafter folder that loads beside the target and decodes losslessly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from celeris.cli import main


def write_rows(folder, ids_list, prompt_len, width, layer_ids):
    """Rows in scripts/drafter_data.py's layout: one shard of ids_i / feat_i and answers.jsonl naming them."""
    folder.mkdir()
    g = torch.Generator().manual_seed(len(ids_list))
    tensors, lines = {}, []
    for i, ids in enumerate(ids_list):
        tensors[f"ids_{i}"] = torch.tensor(ids, dtype=torch.int32)
        tensors[f"feat_{i}"] = torch.randn((len(ids) - 1, width), generator=g).half()
        lines.append(json.dumps({"id": f"r{i}", "shard": "shard-000000.safetensors", "row": i,
                                 "prompt_len": prompt_len, "layer_ids": layer_ids}))
    save_file(tensors, folder / "shard-000000.safetensors")
    (folder / "answers.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.slow  # transformers' import and a save_pretrained: ~12 s
def test_train_dflash_checkpoints_resumes_and_exports_a_drafter_that_loads(tmp_path, capsys, monkeypatch):
    from celeris.llm import LLM
    from celeris.reference.autoregressive import generate_autoregressive
    from tests.models.conftest_causal import tiny_causal

    tiny_causal("llama", tmp_path / "target")  # 2 layers, hidden 32, saved by save_pretrained
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(5, 200, (24,), generator=g).tolist() for _ in range(6)]
    write_rows(tmp_path / "data", rows, 6, 3 * 32, [0, 1, 1])
    write_rows(tmp_path / "held", rows[:2], 6, 3 * 32, [0, 1, 1])
    argv = ["train", "--objective", "dflash", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "data"),
            "--heldout", str(tmp_path / "held"), "--out", str(tmp_path / "run"), "--target-layer-ids", "0,1",
            "--mask-token-id", "3", "--block-size", "4", "--max-steps", "4", "--eval-every", "2",
            "--export", str(tmp_path / "drafter")]
    assert main(argv) == 0, capsys.readouterr().err
    history = [json.loads(x) for x in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [0, 2, 4] and all(h["tau"] >= 1.0 for h in history)
    assert main([*argv[:-2], "--max-steps", "6"]) == 0  # resumes at step 4 from last.pt
    assert "resumed at step 4" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "history.jsonl").read_text().splitlines()[-1])["step"] == 6
    llm = LLM(str(tmp_path / "target"), speculative_config={"model": str(tmp_path / "drafter")})
    prompt = [5, 9, 11, 40]
    params = llm.default_params(max_tokens=10, temperature=0.0)
    assert params.decoding == "verified" and params.draft_source == "lookup_first"
    out = llm.generate([prompt], params)[0]
    want = generate_autoregressive(llm.model, [prompt], llm.default_params(max_tokens=10, decoding="fixed"))
    assert out.token_ids == want.token_ids[0] and llm.proposer.calls > 0
    from celeris.models.quantize import quantization_of

    q = LLM(str(tmp_path / "target"), speculative_config={"model": str(tmp_path / "drafter"), "quantization": "int8"})
    assert quantization_of(q.proposer.drafter) == "int8" and quantization_of(q.model) is None  # the drafter alone
    assert q.generate([prompt], params)[0].token_ids == want.token_ids[0] and q.proposer.calls > 0

    # a session-sized step: from the exported drafter, for a budget (a clock that moves 1 s a reading), shipped
    # over it only if it accepts more; recorded either way
    from celeris.train import dflash, ship

    clock = iter(range(10**6))
    monkeypatch.setattr(dflash.time, "time", lambda: float(next(clock)))
    step_argv = [*argv[:-2], "--out", str(tmp_path / "run2"), "--init", str(tmp_path / "drafter"), "--max-steps",
                 "100000", "--eval-every", "100000", "--time-budget", "30s", "--ship", str(tmp_path / "drafter")]
    assert main(step_argv) == 0, capsys.readouterr().err
    steps = [json.loads(x) for x in (tmp_path / "drafter" / ship.STEPS_FILE).read_text().splitlines()]
    assert len(steps) == 1 and 1 <= steps[0]["steps"] < 30 and steps[0]["total_steps"] == steps[0]["steps"]
    assert isinstance(steps[0]["replaced"], bool) and steps[0]["shipped_tau"] >= 1.0
    history = [json.loads(x) for x in (tmp_path / "run2" / "history.jsonl").read_text().splitlines()]
    assert history[0]["step"] == 0 and history[-1]["step"] == steps[0]["steps"]  # before and after, the same rows
    assert ship.STEPS_HEADING in (tmp_path / "drafter" / "README.md").read_text()


def stub_folders(tmp_path) -> None:
    """Data, held-out and target folders that pass the CLI's checks (their contents are never read)."""
    for name in ("data", "held"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "answers.jsonl").write_text(json.dumps({"id": "r0", "layer_ids": [1]}) + "\n")
    (tmp_path / "target").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "target" / name).write_text("{}")


@pytest.mark.parametrize("given, expected", [
    ([], {"--lr": "0.001", "--batch-size": "4", "--block-size": "8"}),  # DFlash's own defaults
    (["--lr", "1.5e-3", "--batch-size", "8", "--block-size", "4"],  # the other objectives' defaults, given: they count
     {"--lr": "0.0015", "--batch-size": "8", "--block-size": "4"}),
])
def test_a_flag_the_caller_gives_counts_even_at_another_objectives_default(tmp_path, monkeypatch, given, expected):
    from celeris.train import dflash

    stub_folders(tmp_path)
    seen: list[list[str]] = []
    monkeypatch.setattr(dflash, "main", seen.append)
    assert main(["train", "--objective", "dflash", "--data", str(tmp_path / "data"), "--heldout",
                 str(tmp_path / "held"), "--target", str(tmp_path / "target"), "--out", str(tmp_path / "run"),
                 *given]) == 0
    argv = seen[0]
    assert {flag: argv[argv.index(flag) + 1] for flag in expected} == expected


def test_the_other_objectives_keep_their_defaults(monkeypatch, tmp_path):
    from celeris.train import loop

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.bin").write_bytes(b"")
    seen: list = []
    monkeypatch.setattr(loop, "train", lambda cfg: seen.append(cfg) or {})
    assert main(["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run")]) == 0
    assert (seen[0].lr, seen[0].batch_size, seen[0].block_size) == (1.5e-3, 8, 4)


@pytest.mark.parametrize("flags, words", [(["--time-budget", "2 days"], "give a positive duration"),
                                          (["--ship", "nowhere"], "--ship nowhere: no drafter there")])
def test_a_bad_budget_or_ship_folder_is_one_line_and_exit_2(tmp_path, capsys, flags, words):
    stub_folders(tmp_path)
    assert main(["train", "--objective", "dflash", "--data", str(tmp_path / "data"), "--heldout", str(tmp_path / "held"),
                 "--target", str(tmp_path / "target"), "--out", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err


def test_a_missing_init_drafter_is_one_line_and_exit_2(tmp_path, capsys):
    stub_folders(tmp_path)
    assert main(["train", "--objective", "dflash", "--data", str(tmp_path / "data"), "--heldout", str(tmp_path / "held"),
                 "--target", str(tmp_path / "target"), "--out", str(tmp_path / "run"), "--init",
                 str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--init" in err and "no drafter folder or last.pt" in err
