"""train(): outputs, export, and exact resume, on a tiny fake-stdlib corpus."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from celeris.llm import LLM
from celeris.models.loader import load_model
from celeris.sampling.params import SamplingParams
from celeris.train import loop
from celeris.train.loop import TrainConfig, get_batch, lr_at, train
from tests.conftest import TINY_TRAIN_MODEL


def tiny_cfg(corpus_dir, out_dir, **kw) -> TrainConfig:
    base = {"data_dir": str(corpus_dir), "out_dir": str(out_dir), "model": dict(TINY_TRAIN_MODEL), "seq_len": 32,
            "batch_size": 2, "max_steps": 3, "lr": 3e-3, "warmup_steps": 2, "eval_every": 1000, "eval_batches": 1,
            "save_every": 1000, "seed": 0}
    return TrainConfig(**{**base, **kw})


def state_of(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "last.pt", map_location="cpu", weights_only=False)["model"]


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_train_writes_run_and_exports_loadable_checkpoint(corpus_dir, tmp_path):
    cfg = tiny_cfg(corpus_dir, tmp_path / "run", export_dir=str(tmp_path / "export"))
    summary = train(cfg, {"max_tokens": 8, "steps": 8, "block_length": 8})
    run = tmp_path / "run"
    for name in ("last.pt", "history.json", "summary.json", "train_config.json"):
        assert (run / name).is_file(), name
    assert summary["steps"] == 3
    assert summary["tokens_seen"] == 3 * 2 * 32
    assert summary["final_val_loss"] is not None and np.isfinite(summary["final_val_loss"])
    history = json.loads((run / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2, 3]
    assert all(np.isfinite(h["loss"]) for h in history)
    assert json.loads((run / "train_config.json").read_text())["max_steps"] == 3

    model = load_model(tmp_path / "export")
    assert model.config.hidden_size == 32 and model.config.max_position_embeddings == 32
    assert not model.config.is_causal
    assert_same_state({k: v for k, v in model.state_dict().items()}, state_of(run))
    llm = LLM(tmp_path / "export", device="cpu")
    assert llm.tokenizer.vocab_size == model.config.vocab_size
    assert llm.tokenizer.mask_token_id == model.config.mask_token_id
    out = llm.generate("def f(", SamplingParams(max_tokens=4, steps=4, block_length=4))[0]
    assert out.nfe >= 1
    assert json.loads((tmp_path / "export" / "generation_config.json").read_text())["steps"] == 8


def test_resume_with_more_steps_equals_uninterrupted(corpus_dir, tmp_path, capsys):
    """4 steps, then the same run folder with max_steps 6, equals 6 steps in one go.

    warmup_steps > 6 keeps the learning rate independent of max_steps (the cosine phase depends on
    it), so both runs see the same learning rates, batches and noise at every step.
    """
    kw = {"warmup_steps": 100}
    train(tiny_cfg(corpus_dir, tmp_path / "a", max_steps=4, **kw))
    four = state_of(tmp_path / "a")
    capsys.readouterr()
    summary = train(tiny_cfg(corpus_dir, tmp_path / "a", max_steps=6, **kw))
    assert "resuming at step 4" in capsys.readouterr().out
    assert summary["steps"] == 6 and summary["tokens_seen"] == 6 * 2 * 32
    assert [h["step"] for h in json.loads((tmp_path / "a" / "history.json").read_text())] == list(range(1, 7))
    train(tiny_cfg(corpus_dir, tmp_path / "b", max_steps=6, **kw))
    assert_same_state(state_of(tmp_path / "a"), state_of(tmp_path / "b"))
    assert any(not torch.equal(four[k], state_of(tmp_path / "b")[k]) for k in four)  # steps 5-6 did train


def test_resume_after_interruption_equals_uninterrupted(corpus_dir, tmp_path, monkeypatch):
    """A 6-step run killed right after its step-4 checkpoint, then restarted, ends where an
    uninterrupted run ends (cosine schedule active: warmup 2 of 6 steps)."""
    save = loop._atomic_torch_save

    def save_then_crash(obj, path):
        save(obj, path)
        if obj["step"] == 4:
            raise KeyboardInterrupt

    cfg = tiny_cfg(corpus_dir, tmp_path / "a", max_steps=6, save_every=2)
    monkeypatch.setattr(loop, "_atomic_torch_save", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    monkeypatch.setattr(loop, "_atomic_torch_save", save)
    assert torch.load(tmp_path / "a" / "last.pt", weights_only=False)["step"] == 4
    train(cfg)
    train(replace(cfg, out_dir=str(tmp_path / "b")))
    assert_same_state(state_of(tmp_path / "a"), state_of(tmp_path / "b"))


def test_autoregressive_twin_trains_causal(corpus_dir, tmp_path):
    summary = train(tiny_cfg(corpus_dir, tmp_path / "ar", objective="ar", max_steps=2,
                             export_dir=str(tmp_path / "ar_export")))
    assert summary["steps"] == 2 and np.isfinite(summary["final_val_loss"])
    assert load_model(tmp_path / "ar_export").config.is_causal
    # the exported twin decodes token by token through the engine, as the AR decoder does
    from celeris.llm import LLM
    from celeris.reference.autoregressive import generate_autoregressive

    llm = LLM(tmp_path / "ar_export")
    assert llm.generation_config["block_length"] == 1
    params = llm.default_params(max_tokens=6, early_exit=False)
    out = llm.generate("def f", params)[0]
    want = generate_autoregressive(llm.model, [llm.tokenizer.encode("def f")], params, use_cache=False)
    assert out.nfe == 6 and out.token_ids == want.token_ids[0]


def test_hybrid_adapts_a_causal_checkpoint_and_exports_verified_defaults(corpus_dir, tmp_path):
    """--objective hybrid --init TWIN: every weight of the twin, the mask row at the mean embedding, the
    config's draft_block_size, verified decoding by default; its answers equal its greedy next-token ones."""
    from celeris.llm import LLM
    from celeris.reference.autoregressive import generate_autoregressive
    from celeris.train.loop import init_from_checkpoint

    train(tiny_cfg(corpus_dir, tmp_path / "ar", objective="ar", max_steps=2, export_dir=str(tmp_path / "twin")))
    twin = load_model(tmp_path / "twin")
    cfg = tiny_cfg(corpus_dir, tmp_path / "hy", objective="hybrid", init=str(tmp_path / "twin"), block_size=3,
                   max_steps=2, export_dir=str(tmp_path / "hybrid"))
    start = init_from_checkpoint(cfg, {"vocab_size": twin.config.vocab_size, "is_causal": False})
    emb = twin.embed_tokens.weight.detach()
    torch.testing.assert_close(start.embed_tokens.weight[twin.config.mask_token_id], emb.mean(0))
    torch.testing.assert_close(start.layers[0].mlp.down_proj.weight, twin.layers[0].mlp.down_proj.weight)
    summary = train(cfg)
    assert summary["steps"] == 2 and np.isfinite(summary["final_val_loss"])
    history = json.loads((tmp_path / "hy" / "history.json").read_text())
    assert {"val_ntp", "val_masked"} <= set(history[-1])
    llm = LLM(tmp_path / "hybrid")
    assert llm.model.config.draft_block_size == 3 and llm.generation_config["decoding"] == "verified"
    run_model, step = loop.load_run(tmp_path / "hy")  # what the measurement scripts load from a run
    assert step == 2 and run_model.config.draft_block_size == 3
    torch.testing.assert_close(run_model.state_dict(), llm.model.state_dict())
    params = llm.default_params(max_tokens=8, early_exit=False)
    out = llm.generate("def f", params)[0]
    want = generate_autoregressive(llm.model, [llm.tokenizer.encode("def f")], params, use_cache=False)
    assert out.token_ids == want.token_ids[0] and out.nfe <= 8
    with pytest.raises(ValueError, match="init"):
        TrainConfig(data_dir="d", out_dir="o", objective="hybrid")
    with pytest.raises(ValueError, match="init applies"):
        TrainConfig(data_dir="d", out_dir="o", objective="diffusion", init="celeris-code-6m-ar")
    again = init_from_checkpoint(replace(cfg, init=str(tmp_path / "hybrid")), {"vocab_size": twin.config.vocab_size})
    trained = load_model(tmp_path / "hybrid").embed_tokens.weight[twin.config.mask_token_id]
    torch.testing.assert_close(again.embed_tokens.weight[twin.config.mask_token_id], trained)  # kept, not reset
    train(tiny_cfg(corpus_dir, tmp_path / "dl", max_steps=1, export_dir=str(tmp_path / "diffusion")))
    with pytest.raises(ValueError, match="not a causal model"):
        train(tiny_cfg(corpus_dir, tmp_path / "bad", objective="hybrid", init=str(tmp_path / "diffusion"), max_steps=1))


def test_hybrid_refuses_torchrun(corpus_dir, tmp_path, monkeypatch):
    """Its layout calls the layers outside DDP's forward, so gradients would not sync: refused, not wrong."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="one process"):
        train(tiny_cfg(corpus_dir, tmp_path / "hy", objective="hybrid", init="celeris-code-6m-ar"))


def test_hybrid_self_distillation_steps_train_drafts_only(corpus_dir, tmp_path, monkeypatch):
    """With distill_data, odd steps draw whole rows of that file and drop the next-token term."""
    from celeris.train import objective

    train(tiny_cfg(corpus_dir, tmp_path / "ar", objective="ar", max_steps=1, export_dir=str(tmp_path / "twin")))
    rows = np.random.default_rng(0).integers(3, 60, size=(5, 12)).astype(np.uint16)
    rows.tofile(tmp_path / "distill.bin")
    seen = []
    real = objective.hybrid_loss

    def spy(model, batch, gen=None, **kw):
        seen.append((kw.get("ntp_weight", 1.0), batch.shape[1], {tuple(r) for r in batch.tolist()}))
        return real(model, batch, gen, **kw)

    monkeypatch.setitem(loop.OBJECTIVES, "hybrid", spy)
    train(tiny_cfg(corpus_dir, tmp_path / "hy", objective="hybrid", init=str(tmp_path / "twin"), max_steps=4,
                   distill_data=str(tmp_path / "distill.bin"), distill_len=12))
    assert [w for w, _, _ in seen[:4]] == [1.0, 0.0, 1.0, 0.0]  # then the held-out evaluation's calls
    assert seen[1][1] == seen[3][1] == 12 and seen[1][2] <= {tuple(r) for r in rows.tolist()}
    assert seen[0][1] == 32  # corpus windows of seq_len
    with pytest.raises(ValueError, match="hybrid"):
        TrainConfig(data_dir="d", out_dir="o", distill_data="x.bin")


@pytest.mark.parametrize(("field", "value"), [("objective", "gan"), ("seq_len", 0), ("batch_size", 0),
                                               ("max_steps", 0), ("lr", 0.0), ("eval_batches", 0)])
def test_train_config_validation(field, value):
    with pytest.raises(ValueError, match=field if field != "objective" else "objective"):
        TrainConfig(data_dir="d", out_dir="o", **{field: value})


def test_lr_schedule():
    cfg = TrainConfig(data_dir="d", out_dir="o", lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1)
    values = [lr_at(s, cfg) for s in range(10, 111)]
    assert values == sorted(values, reverse=True)


def test_get_batch_is_a_pure_function_of_seed():
    tokens = np.arange(1000, dtype=np.uint16)
    a, b, c = get_batch(tokens, 4, 16, 5), get_batch(tokens, 4, 16, 5), get_batch(tokens, 4, 16, 6)
    assert a.dtype == torch.int64 and a.shape == (4, 16)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 15, dtype=torch.int64))  # contiguous windows
