"""LLaDA checkpoints: loaded natively from the published format and checked against the published equations.

The tiny folders (``conftest_formats.write_llada``) carry the published config
keys and tensor names; the reference below recomputes the logits from the raw
checkpoint tensors with plain float64 loops, written from LLaDA's llama block
(OLMo layout): x += attn_out(attn(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))
with n = rms(x) * attn_norm; x += ff_out(silu(ff_proj(m)) * up_proj(m)) with
m = rms(x) * ff_norm; logits = ff_out(rms(x) * ln_f).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from celeris.llm import LLM
from celeris.models.llada import LLaDAModel
from celeris.models.loader import CheckpointError, estimate_memory, load_any, load_tokenizer, read_headers
from celeris.reference.masked import generate
from celeris.sampling.params import SamplingParams
from tests.models.conftest_formats import (
    llada_shapes,
    padded_batch,
    ref_attention,
    ref_rms,
    ref_rope,
    save_weights,
    write_llada,
)


def llada_reference(state: dict, cfg: dict, ids: torch.Tensor, key_ok: torch.Tensor) -> torch.Tensor:
    """(B, L) ids -> (B, L, vocab_size) float64 logits from the published equations (positions 0..L-1)."""
    d, heads, kv_heads = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"]
    hd, eps, theta = d // heads, cfg["rms_norm_eps"], cfg["rope_theta"]
    w = {k: v.double() for k, v in state.items()}

    def linear(x, name):
        out = x @ w[name + ".weight"].T
        return out + w[name + ".bias"] if name + ".bias" in w else out

    rows = []
    for b in range(ids.shape[0]):
        length = ids.shape[1]
        positions = torch.arange(length)
        x = w["model.transformer.wte.weight"][ids[b]]  # (L, d)
        if cfg["input_emb_norm"]:
            x = x * math.sqrt(d)
        for i in range(cfg["n_layers"]):
            p = f"model.transformer.blocks.{i}."
            n = ref_rms(x, w[p + "attn_norm.weight"], eps)
            q = ref_rope(linear(n, p + "q_proj").view(length, heads, hd), positions, theta)
            k = ref_rope(linear(n, p + "k_proj").view(length, kv_heads, hd), positions, theta)
            v = linear(n, p + "v_proj").view(length, kv_heads, hd)
            x = x + linear(ref_attention(q, k, v, key_ok[b]), p + "attn_out")
            m = ref_rms(x, w[p + "ff_norm.weight"], eps)
            gate = linear(m, p + "ff_proj")
            x = x + linear(gate * torch.sigmoid(gate) * linear(m, p + "up_proj"), p + "ff_out")
        h = ref_rms(x, w["model.transformer.ln_f.weight"], eps)
        head = w["model.transformer.wte.weight"] if cfg["weight_tying"] else w["model.transformer.ff_out.weight"]
        logits = h @ head.T
        if cfg["scale_logits"]:
            logits = logits / math.sqrt(d)
        rows.append(logits[:, : cfg["vocab_size"]])
    return torch.stack(rows)


@pytest.fixture(scope="module")
def llada_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llada") / "LLaDA-tiny"
    cfg, state = write_llada(folder, num_shards=2)
    return folder, cfg, state


@pytest.fixture(scope="module")
def llada(llada_dir):
    return load_any(llada_dir[0])


def test_config_comes_from_published_keys(llada, llada_dir):
    folder, cfg, _ = llada_dir
    c = llada.config
    assert isinstance(llada, LLaDAModel)
    assert (c.d_model, c.n_layers, c.n_heads, c.num_kv_heads, c.intermediate_size) == (32, 2, 4, 2, 48)
    assert (c.mask_token_id, c.eos_token_id, c.pad_token_id) == (
        cfg["mask_token_id"], cfg["eos_token_id"], cfg["pad_token_id"])
    assert c.max_position_embeddings == cfg["max_sequence_length"]
    tok = load_tokenizer(folder, llada)  # tokenizer_config names no mask: the id is config.json's
    assert tok.mask_token_id == cfg["mask_token_id"] == tok._tok.token_to_id("<|mdm_mask|>")
    assert tok.mask_token_id != tok._tok.token_to_id("<|mask|>")
    assert tok.eos_token_id == cfg["eos_token_id"]  # eos_token given as {"content": ...}


def test_logits_match_published_equations(llada, llada_dir):
    _, cfg, state = llada_dir
    ids, mask = padded_batch(cfg["vocab_size"])
    with torch.no_grad():
        got = llada(ids, mask)
        ref = llada_reference(state, cfg, ids, mask)
        assert got.dtype == torch.float32
        assert got.shape == (2, 12, cfg["vocab_size"])  # padded embedding rows (embedding_size) dropped
        assert cfg["embedding_size"] > cfg["vocab_size"]
        assert (got - ref)[mask].abs().max() < 1e-4
        unpadded = llada(ids[:1])  # no mask at all
        assert (unpadded - ref[:1]).abs().max() < 1e-4
        span = llada(ids, mask, logits_slice=slice(5, 9))
        assert torch.allclose(span, got[:, 5:9], atol=1e-6)


def test_single_file_equals_shards(tmp_path, llada_dir):
    _, cfg, state = llada_dir
    folder = tmp_path / "single"
    write_llada(folder, num_shards=1)  # same seed -> same tensors, one file
    assert not (folder / "model.safetensors.index.json").exists()
    a, b = load_any(folder), load_any(llada_dir[0])
    ids = torch.randint(3, cfg["vocab_size"], (1, 7))
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


def test_variant_options_match_reference(tmp_path):
    """Tied output head, q/k/v biases, logit scaling and embedding scaling as the published options define them."""
    folder = tmp_path / "variant"
    cfg, state = write_llada(folder, num_shards=1, seed=3, weight_tying=True, include_qkv_bias=True,
                             scale_logits=True, input_emb_norm=True, n_kv_heads=1)
    model = load_any(folder)
    ids, mask = padded_batch(cfg["vocab_size"], seed=1)
    with torch.no_grad():
        assert (model(ids, mask) - llada_reference(state, cfg, ids, mask))[mask].abs().max() < 1e-4
    assert model.lm_head is None


def test_bfloat16_load(llada_dir):
    model = load_any(llada_dir[0], dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 7]]))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def rewrite_weights(folder, state, **changes):
    for f in folder.glob("model*.safetensors*"):
        f.unlink()
    save_weights(folder, {k: v for k, v in (state | changes).items() if v is not None})


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    folder = tmp_path / "bad"
    cfg, state = write_llada(folder, num_shards=1)
    rewrite_weights(folder, state, **{"model.transformer.blocks.1.k_proj.weight": torch.zeros(8, 32)})
    with pytest.raises(CheckpointError, match=r"'model\.transformer\.blocks\.1\.k_proj\.weight'.*\(8, 32\).*\(16, 32\)"):
        load_any(folder)


def test_missing_and_unexpected_tensors(tmp_path):
    folder = tmp_path / "bad"
    cfg, state = write_llada(folder, num_shards=1)
    rewrite_weights(folder, state, **{"model.transformer.ln_f.weight": None})
    with pytest.raises(CheckpointError, match=r"'model\.transformer\.ln_f\.weight' is missing"):
        load_any(folder)
    rewrite_weights(folder, state, **{"model.transformer.blocks.0.q_proj.bias": torch.zeros(32)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.transformer\.blocks\.0\.q_proj\.bias'"):
        load_any(folder)


def test_missing_shard_and_unsupported_config(tmp_path):
    folder = tmp_path / "bad"
    write_llada(folder, num_shards=2)
    next(folder.glob("model-00002-of-00002.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors.*missing"):
        load_any(folder)
    other = tmp_path / "sequential"
    write_llada(other, num_shards=1, block_type="sequential")
    with pytest.raises(CheckpointError, match="block_type 'sequential'"):
        load_any(other)


def test_memory_estimate_and_refusal(llada_dir, monkeypatch):
    from celeris.models import loader

    folder, cfg, state = llada_dir
    infos = read_headers(sorted(folder.glob("*.safetensors")))
    numel = sum(t.numel() for t in state.values())
    assert estimate_memory(infos, torch.float32, torch.device("cpu")).need_bytes == numel * 4
    assert estimate_memory(infos, torch.bfloat16, torch.device("cpu")).need_bytes == numel * 2
    monkeypatch.setattr(loader, "available_bytes", lambda device: numel * 3)  # float32 needs 4x, bfloat16 2x
    with pytest.raises(CheckpointError, match="not enough memory"):
        load_any(folder)
    assert load_any(folder, dtype=torch.bfloat16) is not None


def test_answer_can_end_when_pad_is_eos(tmp_path):
    """A model that always predicts end-of-text must give an empty answer."""
    folder = tmp_path / "eos"
    cfg, state = write_llada(folder, num_shards=1)
    assert cfg["pad_token_id"] == cfg["eos_token_id"]
    for name in state:  # blocks add nothing; every embedding has a positive first coordinate
        if name.endswith(("attn_out.weight", "ff_out.weight")) and "blocks" in name:
            state[name] = torch.zeros_like(state[name])
    state["model.transformer.wte.weight"][:, 0] = 1.0
    head = torch.zeros_like(state["model.transformer.ff_out.weight"])
    head[cfg["eos_token_id"], 0] = 10.0
    rewrite_weights(folder, state, **{"model.transformer.ff_out.weight": head})
    out = generate(load_any(folder), [[5, 6]], SamplingParams(max_tokens=4, steps=4, block_length=4))
    assert out.token_ids == [[]]


def test_llm_generates_and_renders_chat(llada_dir):
    folder, cfg, _ = llada_dir
    llm = LLM(folder, device="cpu", max_num_seqs=2)
    assert llm.context_length == cfg["max_sequence_length"]
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "add two numbers"}])
    assert prompt.startswith("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nadd two numbers<|eot_id|>")
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    outs = llm.generate([prompt, "def add(a, b):"], SamplingParams(max_tokens=8, steps=8, block_length=8))
    assert len(outs) == 2 and all(isinstance(o.text, str) for o in outs)
    assert all(cfg["mask_token_id"] not in o.token_ids for o in outs)


def test_shapes_helper_matches_published_index_names(llada_dir):
    """Every published tensor name of the fixture is covered by the rename table, and the index lists them all."""
    folder, cfg, _ = llada_dir
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(llada_shapes(cfg))
    assert "model.transformer.blocks.1.ff_out.weight" in index and "model.transformer.ff_out.weight" in index


def test_clip_qkv_is_refused_naming_it(tmp_path):
    """Issue 28 item 11: the published ModelConfig clamps queries, keys and values at ``clip_qkv``; Celeris does not."""
    from tests.models.conftest_formats import write_llada

    write_llada(tmp_path / "a", num_shards=1, clip_qkv=8.0)
    with pytest.raises(CheckpointError, match=r"clip_qkv 8.0 \(only null\)"):
        load_any(tmp_path / "a")
    write_llada(tmp_path / "b", num_shards=1, clip_qkv=None)
    assert isinstance(load_any(tmp_path / "b"), LLaDAModel)
