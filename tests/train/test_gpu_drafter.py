"""The prepared GPU step of drafter training (celeris.train.gpu_drafter) end to end on the CPU at a tiny size, so
that it works the first time a device is lent: answers, features, training from the shipped drafter, held-out
acceptance before and after, the report, and the ship gate."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from celeris.models.dflash import DFlashConfig, DFlashDraftModel, load_dflash, save_dflash

pytestmark = pytest.mark.slow  # transformers' import and a save_pretrained


def test_the_gpu_step_runs_on_the_cpu_at_a_tiny_size(tmp_path):
    from celeris.train import gpu_drafter, ship
    from celeris.train.dflash import load_rows
    from tests.models.conftest_causal import tiny_causal

    target = tiny_causal("llama", tmp_path / "target", max_position_embeddings=256)
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=target.config.vocab_size, num_target_layers=2,
                       block_size=4, rope_theta=10000.0, mask_token_id=3, target_layer_ids=[0, 1])
    save_dflash(DFlashDraftModel(cfg), tmp_path / "init")
    shutil.copytree(tmp_path / "init", tmp_path / "shipped")
    for name, texts in (("prompts", ["tell me a story", "what is a cat", "count to five"]), ("held", ["say hi"])):
        rows = [{"id": f"{name}-{i}", "source": "t", "messages": [{"role": "user", "content": x}]}
                for i, x in enumerate(texts)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = gpu_drafter.main([
        "--out", str(tmp_path / "out"), "--model", str(tmp_path / "target"), "--init", str(tmp_path / "init"),
        "--prompts", str(tmp_path / "prompts.jsonl"), "--heldout", str(tmp_path / "held.jsonl"), "--device", "cpu",
        "--batch-size", "2", "--max-tokens", "12", "--train-budget", "10m", "--max-steps", "3", "--train-batch", "2",
        "--anchors", "4", "--ship", str(tmp_path / "shipped")])
    assert (report["rows"], report["heldout_rows"], report["steps"]) == (3, 1, 3)
    assert report["answer_tokens"] > 0 and report["heldout_tau_before"] >= 1.0 and report["heldout_tau_after"] >= 1.0
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == report
    rows = load_rows(tmp_path / "out" / "data", [0, 1], [0, 1])
    assert len(rows) == 3 and all(r.feats.shape == (len(r.ids) - 1, 64) for r in rows)  # two layers of 32
    # the features are the target's own decoder-layer outputs: transformers' hidden_states[i + 1] (the last
    # layer's there has the final norm on it, so layer 0 is the one to compare)
    with torch.no_grad():
        want = target(rows[0].ids[None], output_hidden_states=True).hidden_states[1][0, :-1]
    torch.testing.assert_close(rows[0].feats[:, :32].float(), want, atol=2e-2, rtol=2e-2)
    trained = load_dflash(tmp_path / "out" / "drafter")
    assert not torch.equal(trained.fc.weight, load_dflash(tmp_path / "init").fc.weight)  # it trained
    steps = [json.loads(x) for x in (tmp_path / "shipped" / ship.STEPS_FILE).read_text().splitlines()]
    assert len(steps) == 1 and steps[0]["replaced"] == report["replaced"] and steps[0]["steps"] == 3
