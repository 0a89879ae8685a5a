"""Llama / Qwen2 / Qwen3 next-token folders, written by transformers' ``save_pretrained``, load natively and give
transformers' own logits (``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``, float32)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from celeris.models.causal import CausalLM
from celeris.models.loader import FORMATS, CheckpointError, load_any, load_tokenizer
from celeris.sampling.step import banned_token_ids
from tests.models.conftest_causal import tiny_causal

TOL = 1e-4


def shifted(hf_logits: torch.Tensor) -> torch.Tensor:
    """transformers' row i predicts token i + 1; Celeris's row i predicts token i (row 0 keeps its own)."""
    return torch.cat([hf_logits[:, :1], hf_logits[:, :-1]], dim=1)


def check_logits(hf: torch.nn.Module, folder, ids: torch.Tensor) -> torch.nn.Module:
    model = load_any(folder)
    assert isinstance(model, CausalLM) and model.config.is_causal
    with torch.no_grad():
        expected = shifted(hf(ids).logits)
        got = model(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOL
    return model


CASES = {  # name -> (family, config overrides)
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-untied-biases-head_dim": ("llama", {"attention_bias": True, "mlp_bias": True, "head_dim": 16}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    "qwen3-attention_bias": ("qwen3", {"attention_bias": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_equal_transformers(case, tmp_path):
    family, overrides = CASES[case]
    hf = tiny_causal(family, tmp_path, **overrides)
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(1))
    model = check_logits(hf, tmp_path, ids)
    tied = overrides.get("tie_word_embeddings", False)
    assert (model.lm_head is None) == tied
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) != tied  # a tied folder has no lm_head tensor, and loads without one


def test_left_padded_batch_equals_transformers_with_its_positions(tmp_path):
    hf = tiny_causal("qwen3", tmp_path)
    model = load_any(tmp_path)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 300, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[1, :4] = False  # left padding
    mask[2, :7] = False
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = shifted(hf(ids, attention_mask=mask.long(), position_ids=positions).logits)
        got = model(ids, mask)
    for row in range(3):
        real = mask[row].nonzero().flatten()
        assert (got[row, real[1:]] - expected[row, real[1:]]).abs().max().item() <= TOL
        # the row's own unpadded forward gives the same logits
        with torch.no_grad():
            alone = model(ids[row : row + 1, real])
        assert (got[row, real[1:]] - alone[0, 1:]).abs().max().item() <= TOL


def test_sharded_folder_loads(tmp_path):
    hf = tiny_causal("llama", tmp_path)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    check_logits(hf, tmp_path, torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(3)))


def test_formats_and_no_mask_token(tmp_path):
    assert {"llama", "qwen2", "qwen3"} <= set(FORMATS)
    tiny_causal("llama", tmp_path, tie_word_embeddings=True)
    model = load_any(tmp_path)
    cfg = model.config
    assert cfg.mask_token_id == cfg.vocab_size  # a placeholder past the vocabulary: no real token is reserved
    assert cfg.pad_token_id == cfg.eos_token_id
    assert banned_token_ids(cfg) == []  # every real token stays producible
    tok = load_tokenizer(tmp_path, model)
    assert tok.eos_token_id == cfg.eos_token_id and tok.chat_template  # chat_template.jinja
    assert tok.end_token_ids(tmp_path) == [cfg.eos_token_id]
    with torch.no_grad():  # the placeholder embeds (as token 0) rather than failing
        placeholder = model(torch.tensor([[5, 6, cfg.mask_token_id]]))
    assert torch.isfinite(placeholder).all()


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope type 'longrope'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_unsupported_settings_are_refused_naming_them(tmp_path, overrides, needle):
    tiny_causal("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **overrides}))
    with pytest.raises(CheckpointError, match=needle):
        load_any(tmp_path)


def test_sliding_window_is_refused(tmp_path):
    tiny_causal("qwen2", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["use_sliding_window"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="use_sliding_window"):
        load_any(tmp_path)


def test_cli_refuses_an_unknown_rope_type_with_one_line(tmp_path, capsys):
    from celeris.cli import main

    tiny_causal("qwen3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # transformers' progress bar while saving
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("celeris: error: ")
    assert err[0].endswith("is not a usable qwen3 config: rope type 'longrope' is not implemented (only default, "
                           "linear, llama3 and yarn are)")
