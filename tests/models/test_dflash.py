"""The DFlash drafter: its cache, its training layout and its folder format against plain recomputation."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from celeris.models.dflash import (
    DFlashConfig,
    DFlashDraftModel,
    DraftKVCache,
    build_target_layer_ids,
    load_dflash,
    save_dflash,
)
from celeris.train.dflash import anchor_layout


def tiny(block_size: int = 4, draft_vocab: int = 0) -> DFlashDraftModel:
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=50, num_target_layers=6, block_size=block_size,
                       rope_theta=10000.0, mask_token_id=3, target_layer_ids=[1, 4], draft_vocab=draft_vocab)
    return DFlashDraftModel(cfg).eval()


def full_pass(model: DFlashDraftModel, embed: torch.Tensor, feats: torch.Tensor, last: int, start: int) -> torch.Tensor:
    """The block [last, mask...] at ``start`` against the context [0, start) with no cache: (bs, d)."""
    bs = model.config.block_size
    block = torch.tensor([[last] + [model.config.mask_token_id] * (bs - 1)])
    positions = torch.arange(start + bs)[None]
    return model(F.embedding(block, embed), feats[None, :start], positions)[0]


def test_default_target_layers_are_dflashs():
    assert build_target_layer_ids(30, 1) == [15]
    assert build_target_layer_ids(30, 2) == [1, 27]
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B's published drafter


def test_cached_drafting_equals_recomputing_the_whole_context():
    """Three drafting calls with the cache lagging one pass (DFlash's loop) == a fresh uncached pass each time."""
    model = tiny()
    embed, head = torch.randn(50, 32), torch.randn(50, 32)
    feats = torch.randn(20, 64)  # target features of 20 positions (2 layers x 32)
    cache = DraftKVCache()
    seen = 0
    for start, last in [(6, 7), (9, 11), (10, 2)]:  # accepted 3 then 1 tokens between the calls
        drafts = model.draft(torch.tensor([last]), feats[None, seen:start], start, cache, embed, head)
        seen = start
        assert cache.length == start  # the block's own keys/values were dropped
        ref = model.draft_logits(full_pass(model, embed, feats, last, start)[None, 1:], head).argmax(-1)
        assert torch.equal(drafts, ref)


def test_the_training_layout_equals_one_block_at_a_time():
    """One masked pass over 3 anchors gives each block what a pass of that block alone over [0, a) gives."""
    model = tiny()
    embed = torch.randn(50, 32)
    feats, ids = torch.randn(1, 16, 64), torch.randint(0, 50, (1, 16))
    anchors = torch.tensor([[3, 8, 12]])
    positions, mask = anchor_layout(16, anchors, 4)
    block = torch.full((1, 3, 4), 3)
    block[:, :, 0] = ids.gather(1, anchors)
    out = model(F.embedding(block.reshape(1, -1), embed), feats, positions, attn_mask=mask).reshape(3, 4, -1)
    for i, a in enumerate(anchors[0].tolist()):
        ref = full_pass(model, embed, feats[0], int(ids[0, a]), a)
        assert (out[i] - ref).abs().max() < 1e-5


def test_a_folder_with_the_published_tensor_names_loads(tmp_path):
    model = tiny(draft_vocab=10)
    model.d2t = torch.arange(0, 20, 2)
    save_dflash(model, tmp_path / "d", dtype=torch.float32)
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1, 4]}
    names = set(json.loads(open(tmp_path / "d" / "model.safetensors", "rb").read(8 + int.from_bytes(
        open(tmp_path / "d" / "model.safetensors", "rb").read(8), "little"))[8:]))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.1.self_attn.k_norm.weight", "layers.1.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= names
    loaded = load_dflash(tmp_path / "d")
    assert torch.equal(loaded.d2t, model.d2t)
    x, f, p = torch.randn(1, 4, 32), torch.randn(1, 5, 64), torch.arange(9)[None]
    assert torch.equal(loaded(x, f, p), model(x, f, p))


def test_a_tensor_of_the_wrong_shape_is_refused_naming_it(tmp_path):
    model = tiny()
    save_dflash(model, tmp_path / "d", dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["fc.weight"] = torch.zeros(32, 32)
    save_file(state, tmp_path / "d" / "model.safetensors")
    with pytest.raises(ValueError, match="fc.weight"):
        load_dflash(tmp_path / "d")


def test_a_config_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, vocab_size=50, num_target_layers=6, target_layer_ids=[7])
