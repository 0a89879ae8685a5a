"""Weight-only quantization (celeris.models.quantize): the kernels against the slow obvious dequantized matmul, the
transform's coverage, and its refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from celeris.config import EngineConfig
from celeris.llm import EMBEDDED, LLM
from celeris.models.dflash import DFlashConfig, DFlashDraftModel
from celeris.models.loader import CheckpointError, load_any
from celeris.models.quantize import (
    Int4Linear,
    Int8Linear,
    QuantizationError,
    QuantizedLinear,
    check_device,
    check_shape,
    int4_group_quantize,
    linear_from_stored,
    pack_nibbles,
    parse_method,
    quantize_model,
    resident_weight_bytes,
    stored_linear,
    unpack_nibbles,
)


def linear(n: int, k: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    m = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        m.weight.normal_(0, 0.05)
    return m


def int8_reference(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric int8 written out: scale = max|w| / 127, q = round(w / scale)."""
    scale = w.abs().amax(1, keepdim=True) / 127
    q = torch.round(w / scale).clamp(-127, 127)
    return x.bfloat16().float() @ (q * scale).T


def int4_reference(w: torch.Tensor, x: torch.Tensor, group: int) -> torch.Tensor:
    """gpt-fast's group dequantization written out: ``(q - 8) * scale + zero`` per group of ``group`` columns."""
    n, k = w.shape
    q, scale, zero = int4_group_quantize(w, group)
    deq = (q.float().reshape(n, k // group, group) - 8) * scale[..., None] + zero[..., None]
    return x.bfloat16().float() @ deq.reshape(n, k).T


@pytest.mark.parametrize("m", [1, 3, 8])
def test_int8_kernel_equals_the_dequantized_matmul(m):
    lin = linear(96, 64)
    x = torch.randn(m, 64)
    got = Int8Linear(lin, torch.bfloat16)(x)
    want = int8_reference(lin.weight.detach(), x)
    assert got.dtype == torch.float32 and got.shape == (m, 96)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # bfloat16 accumulation of the kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_kernel_takes_a_weight_and_scales_read_at_any_offset(dtype):
    """Stored layers come from safetensors files, whose tensors start on 8-byte boundaries: the kernel (whose
    AVX512-BF16 path crashed the process on such a weight) gets 64-byte aligned copies and the same product."""
    lin = linear(64, 64, seed=2)
    ref = Int8Linear(lin, dtype)
    weight_buf, scale_buf = torch.zeros(64 * 64 + 8, dtype=torch.int8), torch.zeros(64 + 4, dtype=dtype)
    weight_buf[8:] = ref.qweight.flatten()
    scale_buf[4:] = ref.scales
    layer = Int8Linear.from_quantized(weight_buf[8:].view(64, 64), scale_buf[4:], None, dtype)
    assert layer.qweight.data_ptr() % 64 == 0 and layer.scales.data_ptr() % 64 == 0
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), ref(x))


@pytest.mark.parametrize("group", [32, 64])
def test_int4_kernel_equals_the_dequantized_matmul(group):
    lin = linear(48, 128, seed=1)
    x = torch.randn(2, 5, 128)
    got = Int4Linear(lin, group, torch.bfloat16)(x)
    want = int4_reference(lin.weight.detach(), x.reshape(10, 128), group).reshape(2, 5, 48)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_int4_groups_reconstruct_the_weight_within_half_a_step():
    w = linear(16, 64).weight.detach()
    q, scale, zero = int4_group_quantize(w, 32)
    deq = ((q.float().reshape(16, 2, 32) - 8) * scale[..., None] + zero[..., None]).reshape(16, 64)
    assert bool(((deq - w).abs() <= scale.repeat_interleave(32, 1) / 2 + 1e-6).all())


def test_bias_and_empty_batches():
    lin = linear(8, 32, bias=True)
    x = torch.randn(3, 32)
    q = Int8Linear(lin, torch.bfloat16)
    torch.testing.assert_close(q(x), int8_reference(lin.weight.detach(), x) + lin.bias.detach(), atol=2e-2, rtol=2e-2)
    assert q(torch.zeros(0, 32)).shape == (0, 8)


def test_every_linear_of_the_transformer_is_replaced_and_the_head_kept(model):
    m = load_any(EMBEDDED / "celeris-code-6m-hybrid")
    before = resident_weight_bytes(m)
    report = quantize_model(m, "int8")
    linears = [n for n, mod in m.named_modules() if isinstance(mod, nn.Linear)]
    quantized = [n for n, mod in m.named_modules() if isinstance(mod, QuantizedLinear)]
    assert linears == [] and len(quantized) == report["layers"] == 4 * m.arch.num_layers
    assert resident_weight_bytes(m) < 0.5 * before  # int8 linears; the tied embedding stays float32
    assert m.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_lm_head_scores_with_a_quantized_copy_of_a_tied_head(method):
    """The head copy is int8 under int4 too (``head_method``: an int4 head missed int4's floor on SmolLM2)."""
    ref, m = load_any(EMBEDDED / "celeris-code-6m"), load_any(EMBEDDED / "celeris-code-6m")
    quantize_model(m, method, quantize_lm_head=True)
    assert any(isinstance(mod, Int4Linear) for mod in m.modules()) == (method == "int4")
    ids = torch.randint(3, 4096, (1, 12))
    h = ref.hidden_states(ids)
    head = m._celeris_quantized_head
    assert isinstance(head, Int8Linear) and head.out_features == m.vocab_size
    want = int8_reference(ref.embed_tokens.weight.detach()[: ref.vocab_size], h[0])
    torch.testing.assert_close(m.logits(h)[0], want, atol=5e-2, rtol=5e-2)


def test_the_drafters_linears_are_quantized_too():
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=50, num_target_layers=6, block_size=4,
                       rope_theta=10000.0, mask_token_id=3, target_layer_ids=[1, 4])
    d = DFlashDraftModel(cfg).eval().requires_grad_(False)
    noise, feats, pos = torch.randn(1, 4, 32), torch.randn(1, 3, 64), torch.arange(7)[None]
    want = d(noise, feats, pos)
    quantize_model(d, "int4")
    assert not [n for n, mod in d.named_modules() if isinstance(mod, nn.Linear)]
    got = d(noise, feats, pos)
    assert got.dtype == torch.float32
    assert float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)) > 0.98


def test_unknown_methods_shapes_and_devices_are_refused_in_one_line():
    with pytest.raises(QuantizationError, match="unknown quantization 'int3'; Celeris has int8, int4"):
        parse_method("int3")
    with pytest.raises(ValueError, match="unknown quantization 'fp4'"):
        EngineConfig(quantization="fp4")
    with pytest.raises(ValueError, match="quantize_lm_head needs a quantization"):
        EngineConfig(quantize_lm_head=True)
    m = load_any(EMBEDDED / "celeris-code-6m")  # intermediate 704: not a multiple of 128
    with pytest.raises(QuantizationError, match=r"layer 'layers.0.mlp.down_proj' has 704 input columns, not a "
                                                r"multiple of the group of 128 \(try int4"):
        quantize_model(m, "int4-g128")
    assert all(isinstance(mod, nn.Linear) for n, mod in m.named_modules() if n.endswith("proj"))  # nothing replaced
    with pytest.raises(QuantizationError, match="layer 'x' has 40 output rows, not a multiple of 16"):
        check_shape(parse_method("int4"), "x", linear(40, 64))
    with pytest.raises(QuantizationError, match=r"fp8: layer 'x' is 40 x 64; torch._scaled_mm takes widths that "
                                                r"are multiples of 16; use int8"):
        check_shape(parse_method("fp8"), "x", linear(40, 64))
    with pytest.raises(QuantizationError, match=r"--quantization int4 has no mps kernel \(it runs on cpu, cuda\)"):
        check_device(parse_method("int4"), "mps")
    with pytest.raises(QuantizationError, match="no meta kernel"):
        check_device(parse_method("int8"), "meta")
    from celeris.models import gguf_quantized

    with pytest.raises(QuantizationError, match="gguf builds its model on the CPU, not cuda"):
        gguf_quantized.load(EMBEDDED / "no-such.gguf", device="cuda")  # refused before the file is read


@pytest.mark.parametrize(("config", "method"), [({"quant_method": "awq", "bits": 4}, "awq"),
                                                ({"quant_method": "gptq"}, "gptq"),
                                                ({"format": "pack-quantized", "config_groups": {}}, "pack-quantized")])
def test_an_already_quantized_checkpoint_is_refused_naming_the_method(tmp_path, config, method):
    folder = tmp_path / "ckpt"
    shutil.copytree(EMBEDDED / "celeris-code-6m", folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    with pytest.raises(CheckpointError, match=f"already quantized checkpoint \\({method}\\)"):
        load_any(folder)


def test_llm_quantizes_after_load_and_decodes():
    llm = LLM("celeris-code-6m-hybrid", device="cpu", quantization="int4")
    assert llm.quantization["method"] == "int4" and llm.quantization["layers"] == 24
    assert llm.engine_config.quantization == "int4"
    out = llm.generate(["def add(a, b):\n"], llm.default_params(max_tokens=8, decoding="verified"))[0]
    assert len(out.token_ids) > 0
    kv = llm.engine.runner.pool  # the KV cache keeps the compute dtype
    assert all(k.dtype == torch.float32 for k in kv.keys)


@pytest.mark.parametrize(("model", "extra"), [("celeris-code-6m", {"block_length": 8, "steps": 24}),
                                              ("celeris-code-6m-hybrid", {"decoding": "verified"})])
def test_structured_output_holds_quantized(model, extra):
    pytest.importorskip("llguidance")
    from celeris.structured.grammar import schema_grammar

    llm = LLM(model, device="cpu", quantization="int4")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    params = llm.default_params(max_tokens=24, temperature=0.0, grammar=schema_grammar(schema), **extra)
    out = llm.generate(["x = "], params)[0]
    assert 0 <= json.loads(out.text)["n"] <= 9


def test_nibbles_hold_two_codes_a_byte_low_first():
    q = torch.randint(0, 16, (48, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = pack_nibbles(q)
    assert packed.shape == (48, 32) and packed.dtype == torch.uint8
    assert int(packed[3, 5]) == int(q[3, 10]) | int(q[3, 11]) << 4
    assert torch.equal(unpack_nibbles(packed), q)


@pytest.mark.parametrize("method", ["int8", "int4", "int4-g64"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_layer_rebuilt_from_its_stored_form_is_the_same_layer(method, bias):
    lin, m = linear(96, 128, bias=bias), parse_method(method)
    x = torch.randn(5, 128)
    direct = Int8Linear(lin, torch.bfloat16) if m.bits == 8 else Int4Linear(lin, m.group, torch.bfloat16)
    form = stored_linear(lin, m, torch.bfloat16)
    again = linear_from_stored({k: v.clone() for k, v in form.items()}, m, torch.bfloat16)
    assert torch.equal(direct(x), again(x))
    assert torch.equal(direct.qweight, again.qweight) and (m.bits == 8 or form["codes"].dtype == torch.uint8)
