"""The loader (``celeris.models.loader``): exact round trip, meta-device build, a CheckpointError for every bad
folder, and every format's name table covering its model."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from celeris.models import loader
from celeris.models.celeris import CelerisModel
from celeris.models.loader import FORMATS, CheckpointError, load_any, load_model, save_checkpoint
from tests.models.conftest_block_formats import write_fast_dllm, write_llada2, write_sdar
from tests.models.conftest_formats import write_dream, write_llada


@pytest.fixture
def saved(model, tokenizer_dir, tmp_path):
    return save_checkpoint(model, tmp_path / "ckpt", tokenizer_dir, {"steps": 8})


def test_round_trip_logits_exact(model, saved):
    loaded = load_model(saved)
    ids = torch.randint(3, 64, (2, 9))
    assert torch.equal(loaded(ids), model(ids))
    assert loaded.config == model.config
    assert not loaded.training


def test_celeris_table_names_every_module_parameter(saved):
    """The Celeris format is a table entry like the others: its identity table covers the state_dict exactly."""
    model = load_model(saved)
    table = loader.FORMATS["celeris"].checkpoint_keys
    targets = {t.replace("{i}", str(i)) for t in table.values() for i in range(len(model.layers))}
    assert set(model.state_dict()) == targets


def test_folder_layout(saved):
    names = {p.name for p in saved.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert json.loads((saved / "generation_config.json").read_text()) == {"steps": 8}
    assert not saved.with_name(saved.name + ".tmp").exists()


def test_resave_keeps_hand_written_files(model, saved, tokenizer_dir):
    (saved / "README.md").write_text("model card\n")
    save_checkpoint(model, saved, tokenizer_dir)
    assert (saved / "README.md").read_text() == "model card\n"
    assert (saved / "model.safetensors").is_file()


def test_load_builds_on_meta_then_assigns(saved, monkeypatch):
    built_on: list[torch.device] = []

    class Spy(CelerisModel):
        def __init__(self, cfg):
            super().__init__(cfg)
            built_on.append(self.embed_tokens.weight.device)

    monkeypatch.setitem(loader.FORMATS, "celeris", dataclasses.replace(loader.FORMATS["celeris"], model_cls=Spy))
    m = load_model(saved)
    assert built_on == [torch.device("meta")]
    assert all(not p.is_meta for p in m.parameters())
    assert all(p.device.type == "cpu" for p in m.parameters())
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_load_with_dtype(saved):
    m = load_model(saved, dtype=torch.bfloat16)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert m(torch.randint(3, 64, (1, 4))).dtype == torch.float32  # the head returns float32 logits


def _rewrite(folder, edit):
    state = load_file(folder / "model.safetensors")
    edit(state)
    save_file(state, folder / "model.safetensors")


def test_wrong_shape_names_tensor_and_both_shapes(saved):
    name = "layers.1.mlp.down_proj.weight"  # (hidden 32, intermediate 64)
    _rewrite(saved, lambda s: s.__setitem__(name, torch.zeros(32, 48)))
    with pytest.raises(CheckpointError) as info:
        load_model(saved)
    message = str(info.value)
    assert name in message
    assert "(32, 48)" in message and "(32, 64)" in message


def test_missing_tensor_is_named(saved):
    name = "layers.0.attn.qkv_proj.weight"
    _rewrite(saved, lambda s: s.pop(name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")) as info:
        load_model(saved)
    assert "(96, 32)" in str(info.value)


def test_unexpected_tensor_is_named(saved):
    _rewrite(saved, lambda s: s.__setitem__("lm_head.weight", torch.zeros(64, 32)))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_model(saved)


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file(saved, name):
    (saved / name).unlink()
    with pytest.raises(CheckpointError, match=name):
        load_model(saved)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_safetensors(saved, damage):
    path = saved / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"garbage": b"\x00not a safetensors file" * 10, "truncated": data[: len(data) // 2],
                      "empty": b""}[damage])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(saved)


def test_corrupt_config(saved):
    (saved / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(saved)


def test_inconsistent_config(saved):
    raw = json.loads((saved / "config.json").read_text())
    raw["mask_token_id"] = raw["vocab_size"] + 5
    (saved / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="mask_token_id"):
        load_model(saved)


def test_config_with_different_size_names_tensor(saved, tmp_path):
    raw = json.loads((saved / "config.json").read_text())
    raw["intermediate_size"] = 80
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    (copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="gate_up_proj") as info:
        load_model(copy)
    assert "(128, 32)" in str(info.value) and "(160, 32)" in str(info.value)


VARIANTS = {  # config overrides that change the module layout (tied head, biases, one K/V head)
    "llada": {"weight_tying": True, "include_qkv_bias": True, "n_kv_heads": 1},
    "dream": {"tie_word_embeddings": True, "num_key_value_heads": 1},
    "sdar": {"tie_word_embeddings": True, "num_key_value_heads": 1, "head_dim": 4},
    "fast_dllm_v2": {"tie_word_embeddings": True, "num_key_value_heads": 1},
    "llada2": {"use_qkv_bias": True, "use_bias": True, "num_key_value_heads": 1, "num_shared_experts": None},
}
ALL_WRITERS = {"llada": write_llada, "dream": write_dream, "sdar": write_sdar, "fast_dllm_v2": write_fast_dllm,
               "llada2": write_llada2}


@pytest.mark.parametrize("name", sorted(ALL_WRITERS))
@pytest.mark.parametrize("variant", [False, True])
def test_checkpoint_keys_name_every_module_parameter(name, variant, tmp_path):
    """The rename table's targets are exactly the model's state_dict names (none missing, none left over)."""
    fmt = FORMATS[name]
    ALL_WRITERS[name](tmp_path, num_shards=1, **(VARIANTS[name] if variant else {}))
    model = load_any(tmp_path)
    num_layers = len(model.layers)
    experts = range(getattr(model.config, "num_experts", 1))  # "{e}": an expert index (mixture of experts)
    targets = {t.replace("{i}", str(i)).replace("{e}", str(e)).split("[")[0] for t in fmt.checkpoint_keys.values()
               for i in range(num_layers) for e in experts}
    assert set(model.state_dict()) <= targets
    assert model.supports_kv_cache


def test_packed_parts_are_checked_one_by_one(tmp_path):
    """Separate published q/k/v tensors are packed into qkv_proj: a missing part is named by its published name,
    and the packed projection equals the published rows stacked q, k, v."""
    write_dream(tmp_path, num_shards=1)
    state = load_file(tmp_path / "model.safetensors")
    model = load_any(tmp_path)
    names = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
    assert torch.equal(model.layers[1].attn.qkv_proj.weight, torch.cat([state[n] for n in names]))
    state.pop(names[1])
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' is missing"):
        load_any(tmp_path)


def test_every_format_names_the_published_keys_it_does_not_read_but_must_check():
    """Issue 28 item 11: a published config key the model does not read, but which changes what the published
    model computes, is declared with the one value Celeris computes (``FormatConfig.FIXED``), never a field."""
    from dataclasses import fields

    from celeris.models.loader import FORMATS

    fixed = {name: fmt.config_cls.FIXED for name, fmt in FORMATS.items() if fmt.config_cls.FIXED}
    assert fixed == {"llada": {"clip_qkv": None}, "llada2": {"use_qk_norm": True, "norm_head": False}}
    for name, keys in fixed.items():
        assert not set(keys) & {f.name for f in fields(FORMATS[name].config_cls)}
