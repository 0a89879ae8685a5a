"""GGUF conversion (celeris.models.gguf) against transformers' own GGUF loader, on tiny files written here.

The oracle for tensors and config is ``transformers``' ``from_pretrained(folder, gguf_file=...)``, which reads the
same file with its own name table and its own reverse permutation (``LlamaTensorProcessor``). The K-quants cannot
be written by ``gguf.quants.quantize``, so those tests write raw random blocks (finite float16 scales) and check
the dequantized values against a plain loop re-implementation of ggml's ``dequantize_row_q{4,5,6}_K`` written
here from the C reference (``ggml-quants.c``), and against ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from celeris.models import gguf as G
from tests.models.conftest_gguf import permute, tiny_checkpoint, write_gguf

gguf = pytest.importorskip("gguf")

# every type gguf.quants.quantize can write, spread over the tensors
MIXED = {"ffn_gate": "Q8_0", "ffn_up": "Q4_0", "ffn_down": "Q4_1", "attn_output": "F16", "attn_v": "Q5_0",
         "attn_k": "Q5_1", "token_embd": "BF16"}


def converted(path):
    reader = G.open_reader(path)
    fields = G.read_fields(reader)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    config = G.hf_config(fields, shapes)
    return config, G.hf_state(reader, config)


@pytest.mark.slow  # imports transformers (~10-30 s on a busy machine)
@pytest.mark.parametrize("arch,tie", [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_tensors_and_config_match_transformers_gguf_loader(tmp_path, arch, tie):
    """llama (q/k permuted in the file), qwen2 (q/k/v biases, untied head), qwen3 (q/k norms): every tensor equals
    what transformers' GGUF loader gives for the same file, bit for bit, and the config agrees."""
    from transformers import AutoModelForCausalLM

    tiny = tiny_checkpoint(arch, tie=tie)
    path = write_gguf(tmp_path / f"{arch}.gguf", tiny, quant=MIXED)
    config, state = converted(path)
    # transformers' qwen3 GGUF mapping does not read attention.key_length: give it the head size
    extra = {"head_dim": config["head_dim"]} if arch == "qwen3" else {}
    oracle = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32, **extra)
    expected = {k: v for k, v in oracle.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert sorted(state) == sorted(expected)
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert config[key] == getattr(oracle.config, key), key
    assert config["rope_theta"] == oracle.config.rope_parameters["rope_theta"]
    assert config["model_type"] == arch and config["head_dim"] == tiny.config["head_dim"]


def test_float_tensors_round_trip_to_the_original_weights(tmp_path):
    """With every tensor F32 the conversion gives back the model the file was written from (the permutation of
    llama's q/k rows undone exactly)."""
    tiny = tiny_checkpoint("llama", tie=False)
    _, state = converted(write_gguf(tmp_path / "f32.gguf", tiny))
    original = tiny.state
    assert sorted(state) == sorted(original)
    for name, tensor in state.items():
        assert torch.equal(tensor, original[name]), name


def test_unpermute_inverts_llama_cpp_permutation():
    weight = torch.randn(3 * 8, 5)
    permuted = torch.from_numpy(permute(weight.numpy(), 3))
    assert not torch.equal(permuted, weight)
    assert torch.equal(G.unpermute(permuted, 3), weight)
    # within a head, llama.cpp's layout interleaves the two halves: rows (0, 4, 1, 5, 2, 6, 3, 7)
    assert torch.equal(permuted[:8], weight[[0, 4, 1, 5, 2, 6, 3, 7]])


# ---------------------------------------------------------------- K-quants (raw random blocks)


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    """ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j from the 12 packed bytes."""
    if j < 4:
        return int(q[j]) & 63, int(q[j + 4]) & 63
    return (int(q[j + 4]) & 0xF) | ((int(q[j - 4]) >> 6) << 4), (int(q[j + 4]) >> 4) | ((int(q[j]) >> 6) << 4)


def _f16(b: np.ndarray) -> float:
    return float(np.frombuffer(b.tobytes(), dtype=np.float16)[0])


def plain_q4_k(block: np.ndarray) -> list[float]:
    """dequantize_row_q4_K for one 144-byte block: d, dmin (f16), scales[12], qs[128]."""
    d, dmin, scales, qs = _f16(block[0:2]), _f16(block[2:4]), block[4:16], block[16:144]
    out = []
    for j in range(4):  # 64 values per step: low nibbles with scale 2j, high nibbles with scale 2j+1
        sc1, m1 = _scale_min_k4(2 * j, scales)
        sc2, m2 = _scale_min_k4(2 * j + 1, scales)
        q = qs[32 * j : 32 * j + 32]
        out += [d * sc1 * (int(x) & 0xF) - dmin * m1 for x in q]
        out += [d * sc2 * (int(x) >> 4) - dmin * m2 for x in q]
    return out


def plain_q5_k(block: np.ndarray) -> list[float]:
    """dequantize_row_q5_K for one 176-byte block: d, dmin (f16), scales[12], qh[32], qs[128]."""
    d, dmin, scales, qh, qs = _f16(block[0:2]), _f16(block[2:4]), block[4:16], block[16:48], block[48:176]
    out = []
    for j in range(4):
        sc1, m1 = _scale_min_k4(2 * j, scales)
        sc2, m2 = _scale_min_k4(2 * j + 1, scales)
        u1, u2 = 1 << (2 * j), 2 << (2 * j)
        q = qs[32 * j : 32 * j + 32]
        out += [d * sc1 * ((int(x) & 0xF) + (16 if int(h) & u1 else 0)) - dmin * m1 for x, h in zip(q, qh, strict=True)]
        out += [d * sc2 * ((int(x) >> 4) + (16 if int(h) & u2 else 0)) - dmin * m2 for x, h in zip(q, qh, strict=True)]
    return out


def plain_q6_k(block: np.ndarray) -> list[float]:
    """dequantize_row_q6_K for one 210-byte block: ql[128], qh[64], scales[16] (int8), d (f16)."""
    ql, qh, sc, d = block[0:128], block[128:192], block[192:208].view(np.int8), _f16(block[208:210])
    out = [0.0] * 256
    for n in range(2):  # two halves of 128 values
        lo, hi, s = ql[64 * n :], qh[32 * n :], sc[8 * n :]
        for i in range(32):
            k = i // 16
            q1 = ((int(lo[i]) & 0xF) | (((int(hi[i]) >> 0) & 3) << 4)) - 32
            q2 = ((int(lo[i + 32]) & 0xF) | (((int(hi[i]) >> 2) & 3) << 4)) - 32
            q3 = ((int(lo[i]) >> 4) | (((int(hi[i]) >> 4) & 3) << 4)) - 32
            q4 = ((int(lo[i + 32]) >> 4) | (((int(hi[i]) >> 6) & 3) << 4)) - 32
            base = 128 * n
            out[base + i] = d * int(s[k]) * q1
            out[base + i + 32] = d * int(s[k + 2]) * q2
            out[base + i + 64] = d * int(s[k + 4]) * q3
            out[base + i + 96] = d * int(s[k + 6]) * q4
    return out


K_QUANTS = {"Q4_K": (144, (0, 2), plain_q4_k), "Q5_K": (176, (0, 2), plain_q5_k), "Q6_K": (210, (208,), plain_q6_k)}


def random_blocks(rng: np.random.Generator, rows: int, blocks: int, size: int, scale_at: tuple[int, ...]) -> np.ndarray:
    """Random bytes, with the float16 super-block scales (d, dmin) set to finite values in [-0.05, 0.05]."""
    raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    for offset in scale_at:
        scales = rng.uniform(-0.05, 0.05, size=(rows, blocks)).astype(np.float16)
        raw[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, blocks, 2)
    return raw


@pytest.mark.parametrize("kind", sorted(K_QUANTS))
def test_k_quants_dequantize_like_ggml(tmp_path, kind):
    """A raw K-quant tensor written into a GGUF dequantizes to ggml's values (plain loop re-implementation above)
    and to ``gguf.quants.dequantize``'s, shaped (rows, columns)."""
    size, scale_at, plain = K_QUANTS[kind]
    rows, blocks = 3, 2
    raw = random_blocks(np.random.default_rng(7), rows, blocks, size, scale_at)
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    qtype = gguf.GGMLQuantizationType[kind]
    writer.add_tensor("blk.0.ffn_down.weight", raw.reshape(rows, blocks * size), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = G.open_reader(tmp_path / "k.gguf").tensors[0]
    got = G.dequantize(tensor)
    assert got.shape == (rows, 256 * blocks) and got.dtype == torch.float32
    expected = torch.tensor([sum((plain(raw[r, b]) for b in range(blocks)), []) for r in range(rows)],
                            dtype=torch.float32)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    library = gguf.quants.dequantize(raw.reshape(rows, blocks * size), qtype)
    assert torch.equal(got, torch.from_numpy(np.asarray(library, dtype=np.float32)))


def test_unlisted_type_is_refused_naming_tensor_and_type(tmp_path):
    path = write_gguf(tmp_path / "iq.gguf", tiny_checkpoint("llama"), quant={"blk.1.attn_output": "IQ4_NL"})
    with pytest.raises(G.GGUFError, match=r"tensor 'blk.1.attn_output.weight' has type IQ4_NL"):
        G.convert(path)


# ---------------------------------------------------------------- Llama 3.1 RoPE: rope_freqs.weight


def converter_rope_freqs(theta: float, head_dim: int, factor: float, low: float, high: float,
                         original: int) -> np.ndarray:
    """What llama.cpp's ``LlamaModel.generate_extra_tensors`` writes for a llama3 rope_scaling, as its loop does."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("theta,head_dim,factor,high,original", [
    (500000.0, 128, 8.0, 4.0, 8192),  # Llama 3.1 8B
    (500000.0, 64, 32.0, 4.0, 8192),  # Llama 3.2 1B
    (10000.0, 16, 8.0, 4.0, 64),  # tiny
])
def test_llama3_scaling_read_back_from_rope_freqs(theta, head_dim, factor, high, original):
    """The divisors llama.cpp writes give back a llama3 rope_scaling whose frequencies (celeris.models.rope, tested
    against transformers by the causal formats' tests) equal the original's."""
    from celeris.models.rope import RopeScaling, rope_frequencies

    divisors = torch.from_numpy(converter_rope_freqs(theta, head_dim, factor, 1.0, high, original))
    scaling = G.llama3_scaling(divisors, theta, head_dim)
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == factor
    assert scaling["original_max_position_embeddings"] == original
    assert scaling["high_freq_factor"] == pytest.approx(high, rel=1e-4)
    original_scaling = RopeScaling("llama3", factor, original, 1.0, high)
    rebuilt = RopeScaling(**scaling)
    torch.testing.assert_close(rope_frequencies(head_dim, theta, rebuilt)[0],
                               rope_frequencies(head_dim, theta, original_scaling)[0], rtol=1e-5, atol=0)


def test_a_gguf_with_rope_freqs_converts_to_a_llama3_config(tmp_path):
    tiny = tiny_checkpoint("llama")
    divisors = converter_rope_freqs(10000.0, 16, 8.0, 1.0, 4.0, 64)
    path = write_gguf(tmp_path / "l3.gguf", tiny, extra={"rope_freqs.weight": divisors})
    config = G.convert(path).config
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert config["rope_scaling"]["original_max_position_embeddings"] == 64
    assert "rope_freqs.weight" not in G.convert(path).state
    with pytest.raises(G.GGUFError, match="rope_freqs.weight"):
        G.llama3_scaling(torch.tensor([1.0, 3.0, 1.5, 8.0]), 10000.0, 8)  # not monotone: no llama3 scaling
