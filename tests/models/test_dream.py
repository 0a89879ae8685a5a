"""Dream checkpoints: loaded natively from the published format, checked against the published equations.

The reference recomputes the logits from the raw checkpoint tensors with plain
float64 loops, from Dream's Qwen2 layer: x += o_proj(attn(rope(q_proj(n)),
rope(k_proj(n)), v_proj(n))) with n = rms(x) * input_layernorm and biased
q/k/v; x += down_proj(silu(gate_proj(m)) * up_proj(m)) with m = rms(x) *
post_attention_layernorm; head = lm_head(rms(x) * norm). Dream's sampler then
shifts: the logits used for position i are the head's output at i-1 (position
0 keeps its own), ``torch.cat([logits[:, :1], logits[:, :-1]], dim=1)``.
"""

from __future__ import annotations

import pytest
import torch

from celeris.llm import LLM
from celeris.models.dream import DreamModel
from celeris.models.loader import CheckpointError, load_any, load_tokenizer
from celeris.sampling.params import SamplingParams
from tests.models.conftest_formats import padded_batch, ref_attention, ref_rms, ref_rope, write_dream


def dream_head_reference(state: dict, cfg: dict, ids: torch.Tensor, key_ok: torch.Tensor) -> torch.Tensor:
    """(B, L) ids -> (B, L, vocab) float64 *unshifted* head outputs; positions count real tokens (Dream's sampler)."""
    d, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps, theta = d // heads, cfg["rms_norm_eps"], cfg["rope_theta"]
    w = {k: v.double() for k, v in state.items()}

    def linear(x, name):
        out = x @ w[name + ".weight"].T
        return out + w[name + ".bias"] if name + ".bias" in w else out

    rows = []
    for b in range(ids.shape[0]):
        length = ids.shape[1]
        positions = (key_ok[b].long().cumsum(0) - 1).clamp(min=0)
        x = w["model.embed_tokens.weight"][ids[b]]  # (L, d)
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            n = ref_rms(x, w[p + "input_layernorm.weight"], eps)
            q = ref_rope(linear(n, p + "self_attn.q_proj").view(length, heads, hd), positions, theta)
            k = ref_rope(linear(n, p + "self_attn.k_proj").view(length, kv_heads, hd), positions, theta)
            v = linear(n, p + "self_attn.v_proj").view(length, kv_heads, hd)
            x = x + linear(ref_attention(q, k, v, key_ok[b]), p + "self_attn.o_proj")
            m = ref_rms(x, w[p + "post_attention_layernorm.weight"], eps)
            gate = linear(m, p + "mlp.gate_proj")
            x = x + linear(gate * torch.sigmoid(gate) * linear(m, p + "mlp.up_proj"), p + "mlp.down_proj")
        h = ref_rms(x, w["model.norm.weight"], eps)
        head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
        rows.append(h @ head.T)
    return torch.stack(rows)


def shift(logits: torch.Tensor) -> torch.Tensor:
    """Dream's own shift, as its generation code writes it."""
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


@pytest.fixture(scope="module")
def dream_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dream") / "Dream-tiny"
    cfg, state = write_dream(folder)
    return folder, cfg, state


@pytest.fixture(scope="module")
def dream(dream_dir):
    return load_any(dream_dir[0])


def test_config_comes_from_published_keys(dream, dream_dir):
    folder, cfg, _ = dream_dir
    c = dream.config
    assert isinstance(dream, DreamModel)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (32, 2, 4, 2)
    assert (c.mask_token_id, c.eos_token_id, c.pad_token_id) == (
        cfg["mask_token_id"], cfg["eos_token_id"], cfg["pad_token_id"])
    assert c.max_position_embeddings == cfg["max_position_embeddings"]
    tok = load_tokenizer(folder, dream)
    assert tok.mask_token_id == cfg["mask_token_id"]  # mask_token given as {"content": "<|mask|>", ...}


def test_logits_match_published_equations_with_shift(dream, dream_dir):
    _, cfg, state = dream_dir
    ids, mask = padded_batch(cfg["vocab_size"], pad=3)
    with torch.no_grad():
        got = dream(ids, mask)
        ref = shift(dream_head_reference(state, cfg, ids, mask))
        assert got.dtype == torch.float32 and got.shape == (2, 12, cfg["vocab_size"])
        assert (got - ref)[mask].abs().max() < 1e-4
        assert (dream(ids[:1]) - ref[:1]).abs().max() < 1e-4


def test_shift_and_logits_slice(dream, dream_dir):
    """Output i is the head applied to hidden state i-1 (0 to itself), also for a slice that starts mid-sequence."""
    _, cfg, _ = dream_dir
    ids = torch.randint(3, cfg["vocab_size"], (2, 10))
    with torch.no_grad():
        full = dream(ids)
        unshifted = dream.logits(dream(ids, return_hidden=True))  # (B, L, V): head without shift
        assert torch.allclose(full[:, 1:], unshifted[:, :-1], atol=1e-6)
        assert torch.allclose(full[:, 0], unshifted[:, 0], atol=1e-6)
        assert not torch.allclose(full[:, 1:], unshifted[:, 1:], atol=1e-3)
        for span in (slice(4, 8), slice(0, 3), slice(7, 10)):
            assert torch.allclose(dream(ids, logits_slice=span), full[:, span], atol=1e-6)


def test_ids_from_tokenizer_files_tied_head_and_shards(tmp_path):
    """No mask/pad id in config.json: they come from tokenizer_config.json; tied head; sharded weights."""
    folder = tmp_path / "tied"
    cfg, state = write_dream(folder, num_shards=3, seed=5, drop_ids=("mask_token_id", "pad_token_id"),
                             tie_word_embeddings=True, num_key_value_heads=1)
    assert (folder / "model.safetensors.index.json").is_file()
    model = load_any(folder)
    assert model.lm_head is None
    assert model.config.mask_token_id == cfg["mask_token_id"]
    assert model.config.pad_token_id == cfg["pad_token_id"]
    ids, mask = padded_batch(cfg["vocab_size"], seed=2, pad=3)
    with torch.no_grad():
        ref = shift(dream_head_reference(state, cfg, ids, mask))
        assert (model(ids, mask) - ref)[mask].abs().max() < 1e-4


def test_unsupported_settings_are_refused(tmp_path):
    folder = tmp_path / "yarn"
    write_dream(folder, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(CheckpointError, match="rope_scaling"):
        load_any(folder)
    folder = tmp_path / "nomask"
    write_dream(folder, drop_ids=("mask_token_id",))
    cfg = (folder / "tokenizer_config.json").read_text().replace('"mask_token"', '"unused_token"')
    (folder / "tokenizer_config.json").write_text(cfg)
    with pytest.raises(CheckpointError, match="no mask_token_id"):
        load_any(folder)


def test_llm_generates_and_renders_chat(dream_dir):
    folder, cfg, _ = dream_dir
    llm = LLM(folder, device="cpu", max_num_seqs=2)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    outs = llm.generate([prompt], SamplingParams(max_tokens=8, steps=8, block_length=8))
    assert len(outs) == 1 and isinstance(outs[0].text, str)
    assert cfg["mask_token_id"] not in outs[0].token_ids
