"""CelerisModel: ids -> logits, padding invariance, bidirectional vs causal attention, config I/O."""

from __future__ import annotations

import json

import pytest
import torch

from celeris.models.celeris import CelerisConfig, CelerisModel, count_parameters
from tests.conftest import TINY, tiny_config


def test_forward_shape_dtype_and_finite(model):
    ids = torch.randint(3, 64, (3, 10))
    logits = model(ids)
    assert logits.shape == (3, 10, 64)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_logits_slice_equals_slicing_full_logits(model):
    ids = torch.randint(3, 64, (2, 12))
    full = model(ids)
    part = model(ids, logits_slice=slice(4, 9))
    assert part.shape == (2, 5, 64)
    torch.testing.assert_close(part, full[:, 4:9])


def test_return_hidden_gives_hidden_states(model):
    ids = torch.randint(3, 64, (2, 7))
    hidden = model(ids, return_hidden=True)
    assert hidden.shape == (2, 7, 32)
    torch.testing.assert_close(model.logits(hidden), model(ids))


def test_left_padding_is_invisible(model):
    """A left-padded row computes what the unpadded row computes (padding read as prompt is a known bug)."""
    row = torch.randint(3, 64, (1, 6))
    alone = model(row, torch.ones(1, 6, dtype=torch.bool))
    padded = torch.cat([torch.full((1, 4), model.config.pad_token_id), row], dim=1)
    mask = torch.tensor([[False] * 4 + [True] * 6])
    # a different token in the padding must not matter either
    padded_other = padded.clone()
    padded_other[0, :4] = 7
    out = model(padded, mask)[:, 4:]
    out_other = model(padded_other, mask)[:, 4:]
    torch.testing.assert_close(out, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_other, out)


def test_attention_is_bidirectional(model):
    ids = torch.randint(3, 64, (1, 8))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1 - 3) % 61 + 3
    # position 0 sees the last token, so its logits change
    assert not torch.allclose(model(ids)[0, 0], model(changed)[0, 0])


def test_causal_model_ignores_the_future(make_model):
    causal = make_model(is_causal=True)
    ids = torch.randint(3, 64, (1, 8))
    changed = ids.clone()
    changed[0, 5:] = (ids[0, 5:] + 1 - 3) % 61 + 3
    a, b = causal(ids), causal(changed)
    # row i predicts token i from the hidden state at i - 1 (row 0 from its own): rows up to 5 ignore token 5
    torch.testing.assert_close(a[0, :6], b[0, :6])
    assert not torch.allclose(a[0, 6:], b[0, 6:])
    with torch.no_grad():
        head = causal.logits(causal.hidden_states(ids))  # (1, 8, V), unshifted
    torch.testing.assert_close(a[0, 1:], head[0, :-1])
    torch.testing.assert_close(a[0, 0], head[0, 0])
    # the causal mask still holds when an attention mask is passed (padding path)
    mask = torch.ones(1, 8, dtype=torch.bool)
    torch.testing.assert_close(causal(ids, mask)[0, :5], causal(changed, mask)[0, :5])


def test_output_head_is_tied(model):
    hidden = torch.randn(2, 32)
    torch.testing.assert_close(model.logits(hidden), hidden @ model.embed_tokens.weight.T)
    names = [n for n, _ in model.named_parameters()]
    assert not any("lm_head" in n for n in names)
    assert count_parameters(model) == sum(p.numel() for p in model.parameters())


def test_init_weights_scales_output_projections(make_model):
    m = make_model()
    m.init_weights(std=0.02)
    assert torch.all(m.norm.weight == 1)
    emb_std = float(m.embed_tokens.weight.detach().std())
    o_std = float(m.layers[0].attn.o_proj.weight.detach().std())
    assert 0.015 < emb_std < 0.025
    assert o_std == pytest.approx(0.02 / 2, rel=0.25)  # 1/sqrt(2 * num_layers) with 2 layers


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="num_heads"):
        tiny_config(hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="mask_token_id"):
        tiny_config(mask_token_id=64)
    with pytest.raises(ValueError, match="pad_token_id"):
        tiny_config(pad_token_id=-1)


def test_config_json_round_trip_ignores_unknown_keys(tmp_path):
    cfg = tiny_config(rope_theta=500.0)
    cfg.to_json(tmp_path / "config.json")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["CelerisForMaskedDiffusion"]
    raw["some_future_key"] = 1
    (tmp_path / "config.json").write_text(json.dumps(raw))
    back = CelerisConfig.from_json(tmp_path / "config.json")
    assert back == cfg
    assert back.head_dim == TINY["hidden_size"] // TINY["num_heads"]


def test_same_seed_same_weights():
    torch.manual_seed(3)
    a = CelerisModel(tiny_config())
    torch.manual_seed(3)
    b = CelerisModel(tiny_config())
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
