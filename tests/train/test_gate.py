"""The checkpoint gate: held-out function prompts and their parse rate (celeris/train/gate.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from celeris.train import gate, loop
from tests.train.test_loop import tiny_cfg

SOURCE = '''import os


def first(a, b):
    """Add two numbers."""
    return a + b


class K:
    def method(self, x):
        """Return x.

        Twice documented.
        """
        return x

    def plain(self):
        return 1


def no_docstring():
    pass
'''


def test_function_prompts_are_headers_with_docstrings_at_column_0(corpus_dir):
    tok = Tokenizer.from_file(str(corpus_dir / "tokenizer.json"))
    ids = np.asarray(tok.encode(SOURCE).ids, dtype=np.uint16)
    prompts = gate.function_prompts(ids, tok, count=10)
    assert prompts == ['def first(a, b):\n    """Add two numbers."""',
                       'def method(self, x):\n    """Return x.\n\n    Twice documented.\n    """']
    assert gate.function_prompts(ids, tok, count=1) == prompts[:1]
    assert gate.function_prompts(ids, tok, count=10, max_chars=50) == prompts[:1]


def test_parse_rate_scores_the_cut_completion_with_its_prompt(corpus_dir, make_model, monkeypatch):
    """The HumanEval harness's rule: code up to the first column-0 line, parsed with the prompt; the answer is
    cut at end-of-text; a comment-only body does not count, nor a run of string literals (it parses: adjacent
    strings join; a degenerate model's repetition)."""
    tok = Tokenizer.from_file(str(corpus_dir / "tokenizer.json"))
    model = make_model(is_causal=True)
    completions = ["\n    return a + b\nprint(1)", "\n    return (", "\n    # nothing", ' """ """ """ """ """ """']
    eos = model.config.eos_token_id
    answers = [tok.encode(c).ids + [eos] + tok.encode(" (((").ids for c in completions]
    seen = {}

    def fake(m, ids, params):
        seen["params"] = params
        return type("Out", (), {"token_ids": answers})()

    monkeypatch.setattr(gate, "generate_autoregressive", fake)
    prompt = 'def f(a, b):\n    """Add."""'
    model.train()
    assert gate.parse_rate(model, tok, [prompt] * 4, max_tokens=16) == pytest.approx(1 / 4)
    assert model.training and seen["params"].temperature == 0.0 and seen["params"].max_tokens == 16
    assert gate.parse_rate(model, tok, []) == 0.0


def test_training_exports_the_best_gated_checkpoint(corpus_dir, tmp_path, monkeypatch):
    """Scored before training and at every save; the export is the best (ties: the later), not the last."""
    loop.train(tiny_cfg(corpus_dir, tmp_path / "ar", objective="ar", max_steps=1, export_dir=str(tmp_path / "twin")))
    rates = iter([0.25, 0.5, 0.75, 0.5])  # before training, steps 1, 2, 3
    monkeypatch.setattr(loop, "function_prompts", lambda tokens, tok, count: ["def f():"] * count)
    monkeypatch.setattr(loop, "parse_rate", lambda model, tok, prompts, tokens: next(rates))
    cfg = tiny_cfg(corpus_dir, tmp_path / "run", objective="ar", init=str(tmp_path / "twin"), max_steps=3,
                   save_every=1, gate_prompts=4, export_dir=str(tmp_path / "export"))
    summary = loop.train(cfg)
    assert summary["exported_step"] == 2 and summary["gate_parse_rate"] == 0.75
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    assert [h["gate_parse_rate"] for h in history] == [0.25, 0.5, 0.75, 0.5]
    best = torch.load(tmp_path / "run" / "best.pt", weights_only=False)
    exported = loop.load_model(tmp_path / "export").state_dict()
    last = torch.load(tmp_path / "run" / "last.pt", weights_only=False)["model"]
    assert all(torch.equal(exported[k], best["model"][k]) for k in best["model"])
    assert not all(torch.equal(exported[k], last[k]) for k in last)


@pytest.mark.parametrize("kw", [{"gate_prompts": -1}, {"gate_tokens": 0}, {"gate_prompts": 4},
                                {"certainty_weight": 0.1}, {"certainty_weight": -1.0, "distill_data": "x"}])
def test_gate_and_certainty_settings_are_validated(kw):
    with pytest.raises(ValueError):
        loop.TrainConfig(data_dir="d", out_dir="o", **kw)
