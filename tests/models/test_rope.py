"""RoPE scalings (linear, llama3, yarn) as transformers computes them, in both config spellings, and the
logits of scaled models past ``original_max_position_embeddings``."""

from __future__ import annotations

import json

import pytest
import torch

from celeris.models.loader import load_any
from celeris.models.rope import RopeScaling, read_rope, rope_frequencies
from tests.models.conftest_causal import tiny_causal
from tests.models.test_causal import TOL, shifted

SCALINGS = {  # published values: Llama-3.1-8B (llama3), Qwen2.5-7B-Instruct's long-context note (yarn)
    "linear": ({"rope_type": "linear", "factor": 4.0}, 128, 10000.0, 4096),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}, 128, 500000.0, 131072),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 128, 1e6, 131072),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                     "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2}, 64, 10000.0, 163840),
    "yarn-no-truncate": ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048,
                          "truncate": False, "attention_factor": 1.2}, 64, 10000.0, 4096),
}


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_frequencies_and_attention_factor_equal_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params, head_dim, theta, context = SCALINGS[name]
    cfg = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                      max_position_embeddings=context, rope_parameters={**params, "rope_theta": theta})
    expected, expected_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    got_theta, scaling = read_rope({"rope_parameters": {**params, "rope_theta": theta}}, context, 10000.0)
    got, factor = rope_frequencies(head_dim, got_theta, scaling)
    assert got_theta == theta and scaling.rope_type == params["rope_type"]
    assert torch.allclose(got, expected.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)


def test_both_spellings_and_the_old_type_key_read_alike():
    new = read_rope({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}, 64, 1e4)
    old = read_rope({"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 500.0}, 64, 1e4)
    assert new == old == (500.0, RopeScaling("linear", factor=2.0, original_max_position_embeddings=64))
    assert read_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}, 64, 1e4) == (7.0, None)
    assert read_rope({"rope_scaling": None, "rope_theta": 3.0}, 64, 1e4) == (3.0, None)
    with pytest.raises(ValueError, match="rope type 'dynamic' is not implemented"):
        read_rope({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, 64, 1e4)


TINY_SCALINGS = {  # family, rope parameters, spelling in config.json
    "linear-llama-rope_scaling": ("llama", {"rope_type": "linear", "factor": 3.0}, "rope_scaling"),
    "llama3-llama": ("llama", {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16}, "rope_parameters"),
    "yarn-qwen2-rope_scaling": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                                "rope_scaling"),
    "yarn-qwen3": ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                   "rope_parameters"),
}


@pytest.mark.parametrize("name", sorted(TINY_SCALINGS))
def test_scaled_models_give_transformers_logits_past_the_original_context(name, tmp_path):
    family, params, spelling = TINY_SCALINGS[name]
    hf = tiny_causal(family, tmp_path, head_dim=16, rope_parameters={**params, "rope_theta": 100.0})
    if spelling == "rope_scaling":  # transformers 4's spelling: rope_theta beside it
        config = json.loads((tmp_path / "config.json").read_text())
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = rope
        (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_any(tmp_path)
    assert model.arch.rope_scaling.rope_type == params["rope_type"]
    ids = torch.randint(0, 300, (1, 48), generator=torch.Generator().manual_seed(4))  # 3x the original 16
    with torch.no_grad():
        expected = shifted(hf(ids).logits)
        got = model(ids)
    assert (got - expected).abs().max().item() <= TOL
    with torch.no_grad():  # and the scaling is not a no-op here: plain RoPE gives other logits
        plain = tiny_causal(family, None, head_dim=16, vocab_size=hf.config.vocab_size,
                            rope_parameters={"rope_type": "default", "rope_theta": 100.0})
        plain.load_state_dict(hf.state_dict())
        assert (shifted(plain(ids).logits) - expected)[:, 17:].abs().max().item() > 1e-2
