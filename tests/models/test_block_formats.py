"""SDAR and Fast-dLLM v2 folders: loaded natively from the published format, checked against transformers'
own Qwen3ForCausalLM / Qwen2ForCausalLM given the block-causal 4D mask (an implementation not written here)."""

from __future__ import annotations

import pytest
import torch

from celeris.models.contract import layout_mask, noisy_clean_mask
from celeris.models.fast_dllm import FastDLLMModel
from celeris.models.loader import CheckpointError, load_any, load_tokenizer
from celeris.models.sdar import SDARModel
from tests.models.conftest_block_formats import write_fast_dllm, write_sdar


def hf_model(kind: str, cfg: dict, state: dict) -> torch.nn.Module:
    """transformers' Qwen3ForCausalLM (SDAR) or Qwen2ForCausalLM (Fast-dLLM v2) on the same tensors, float64."""
    import transformers

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "rope_theta", "tie_word_embeddings")
    kwargs = {k: cfg[k] for k in keys}
    if kind == "sdar":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=cfg["head_dim"], **kwargs))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs))
    model.load_state_dict({k: v.double() for k, v in state.items()})
    model.config._attn_implementation = "eager"
    return model.double().eval()


def block_causal(length: int, block: int) -> torch.Tensor:
    """SDAR's inference mask: ``tril(ones(nb, nb))`` expanded to blocks, (1, 1, L, L) bool."""
    nb = -(-length // block)
    blocks = torch.tril(torch.ones(nb, nb, dtype=torch.bool))
    return blocks.repeat_interleave(block, 0).repeat_interleave(block, 1)[:length, :length][None, None]


def additive(mask: torch.Tensor) -> torch.Tensor:
    """transformers' custom 4D masks are additive float masks: 0 where attended, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sdar") / "SDAR-tiny"
    cfg, state = write_sdar(folder)
    return folder, cfg, state


@pytest.fixture(scope="module")
def fast_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fast") / "Fast-dLLM-tiny"
    cfg, state = write_fast_dllm(folder)
    return folder, cfg, state


def test_sdar_logits_match_transformers_qwen3_with_block_mask(sdar_dir):
    folder, cfg, state = sdar_dir
    model = load_any(folder, dtype=torch.float64)
    assert isinstance(model, SDARModel) and model.block_contract.block_size == 4
    tok = load_tokenizer(folder, model)
    assert model.config.mask_token_id == tok._tok.token_to_id("<|MASK|>")  # from the contract's mask token
    ids = torch.randint(3, cfg["vocab_size"], (1, 10), generator=torch.Generator().manual_seed(0))
    mask = block_causal(10, 4)
    expected = hf_model("sdar", cfg, state)(ids, attention_mask=additive(mask)).logits
    hidden = model.hidden_states(ids, layout_mask=mask)
    torch.testing.assert_close(model.logits(hidden).double(), expected, atol=1e-5, rtol=1e-5)


def test_fast_dllm_logits_match_transformers_qwen2_with_block_mask(fast_dir):
    folder, cfg, state = fast_dir
    model = load_any(folder, dtype=torch.float64)
    assert isinstance(model, FastDLLMModel) and model.block_contract.block_size == cfg["bd_size"]
    assert model.logits_shift == 1
    ids = torch.randint(3, cfg["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(1))
    mask = block_causal(12, cfg["bd_size"])
    expected = hf_model("fast", cfg, state)(ids, attention_mask=additive(mask)).logits
    hidden = model.hidden_states(ids, layout_mask=mask)
    torch.testing.assert_close(model.logits(hidden).double(), expected, atol=1e-5, rtol=1e-5)


def test_layout_mask_matches_published_block_mask():
    cols = torch.arange(10)[None]
    ours = layout_mask(cols, 10, torch.tensor([8]), torch.tensor([10]), torch.tensor([0]), 4, "block_causal")
    assert torch.equal(ours, block_causal(10, 4))


@pytest.mark.parametrize("attention", ["block_causal", "causal_history"])
def test_training_layout_equals_incremental_inference(sdar_dir, attention):
    """BD3-LM's x_t (+) x_0 training pass scores each noisy block as inference does: the block's queries
    over the clean history (computed by the layout) and the noisy block itself."""
    model = load_any(sdar_dir[0], dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    length, bs, mask_id = 12, 4, model.config.mask_token_id
    clean = torch.randint(3, 200, (1, length), generator=g)
    noisy = torch.where(torch.rand(1, length, generator=g) < 0.5, mask_id, clean)
    ids = torch.cat([noisy, clean], dim=1)
    positions_ids = torch.arange(length).repeat(2)[None]
    hidden = train_hidden(model, ids, positions_ids, noisy_clean_mask(length, bs, attention)[None, None])
    for b in range(length // bs):
        canvas = torch.cat([clean[:, : b * bs], noisy[:, b * bs : (b + 1) * bs]], dim=1)
        cols = torch.arange(canvas.shape[1])[None]
        mask = layout_mask(cols, canvas.shape[1], torch.tensor([b * bs]), torch.tensor([(b + 1) * bs]),
                           torch.tensor([0]), bs, attention)
        inference = model.hidden_states(canvas, layout_mask=mask)[:, b * bs :]
        torch.testing.assert_close(hidden[:, b * bs : (b + 1) * bs], inference, atol=1e-10, rtol=1e-10)


def train_hidden(model, ids, positions, mask):
    """The training pass: the shared layers on caller positions (both copies at 0..L-1) and a 4D mask."""
    from celeris.models.layers import rope_cos_sin

    cos, sin = rope_cos_sin(positions, model.arch.head_dim, model.arch.rope_theta)
    x = model.embed(ids)
    for layer in model.layers:
        x = layer(x, cos, sin, mask)
    return model.norm(x)


def test_mask_id_outside_a_vocabulary_without_the_mask_token_is_refused(tmp_path):
    folder = tmp_path / "sdar"
    write_sdar(folder)
    tok = (folder / "tokenizer.json").read_text().replace("<|MASK|>", "<|NOMASK|>")
    (folder / "tokenizer.json").write_text(tok)
    # the last source is the contract's published id 151669, which this tiny vocabulary does not have
    with pytest.raises(CheckpointError, match="mask_token_id=151669 is outside the vocabulary"):
        load_any(folder)


def test_unsupported_settings_are_refused(tmp_path):
    write_sdar(tmp_path / "a", attention_bias=True)
    with pytest.raises(CheckpointError, match="attention_bias"):
        load_any(tmp_path / "a")
    write_fast_dllm(tmp_path / "b", layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(CheckpointError, match="sliding"):
        load_any(tmp_path / "b")


def test_config_block_size_overrides_the_table(tmp_path):
    write_sdar(tmp_path / "s", block_size=8)
    model = load_any(tmp_path / "s")
    assert model.block_contract.block_size == 8 and model.block_contract.defaults["block_length"] == 8


def test_memory_estimate_and_refusal(sdar_dir, monkeypatch):
    from celeris.models import loader

    folder, _, state = sdar_dir
    numel = sum(t.numel() for t in state.values())
    monkeypatch.setattr(loader, "available_bytes", lambda device: numel * 3)  # float32 needs 4x, bfloat16 2x
    with pytest.raises(CheckpointError, match="not enough memory"):
        load_any(folder)
    assert load_any(folder, dtype=torch.bfloat16) is not None


def test_default_block_length_always_fits_the_folders_block_size(tmp_path):
    """Fast-dLLM v2's default 8-token sub-block cannot decode a bd_size 4 folder: its defaults follow the folder."""
    from celeris.llm import LLM
    from celeris.models.contract import CONTRACTS

    fast = CONTRACTS["fast_dllm_v2"]
    assert {n: fast.with_block_size(n).defaults["block_length"] for n in (4, 12, 16, 64)} == {4: 4, 12: 6, 16: 8,
                                                                                            64: 8}
    assert fast.with_block_size(4).defaults["steps"] == 4 and CONTRACTS["sdar"].with_block_size(8).defaults[
        "block_length"] == 8
    write_fast_dllm(tmp_path, bd_size=4)
    llm = LLM(tmp_path, device="cpu")
    out = llm.generate(["def f(x):"], llm.default_params(max_tokens=6))[0]
    assert llm.model.block_contract.block_size == 4 and out.finish_reason in ("stop", "length") and out.nfe >= 1


def test_sliding_window_layer_types_are_refused_for_every_qwen_format(tmp_path):
    """Qwen3's config (SDAR) has layer_types too: a sliding-window layer is refused naming it, as Fast-dLLM v2's."""
    write_sdar(tmp_path / "a", layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(CheckpointError, match=r"layer_types \['sliding_attention'\]"):
        load_any(tmp_path / "a")


def test_rope_parameters_are_read_and_a_scaled_rope_is_refused(tmp_path):
    """transformers 5 writes RoPE as rope_parameters: its rope_theta is the one the model uses (not silently
    ignored); a scaled RoPE, which the block formats do not compute, is refused naming it."""
    write_sdar(tmp_path / "a", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert load_any(tmp_path / "a").config.rope_theta == 10000.0
    write_sdar(tmp_path / "b", rope_parameters={"rope_type": "yarn", "rope_theta": 1000000, "factor": 4.0})
    with pytest.raises(CheckpointError, match="only plain RoPE"):
        load_any(tmp_path / "b")
    write_sdar(tmp_path / "c", rope_parameters={"rope_type": "default", "rope_theta": 1000000})
    assert load_any(tmp_path / "c").block_contract.block_size == 4
