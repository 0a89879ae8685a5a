"""Float32 linears through oneDNN with prepacked weights (celeris.models.prepack), against the obviously correct
``F.linear`` on the same weights: the same products up to float32 rounding, a row's result independent of the rows
beside it, the same logits for whole models (tied and untied heads, q/k/v biases), applied by ``LLM`` by default on a
CPU and switched off by ``onednn=False`` / ``--no-onednn``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from celeris.llm import LLM
from celeris.models import prepack
from celeris.models.prepack import PrepackedLinear, prepack_model, reference_linear, weight_tensors
from celeris.models.quantize import resident_weight_bytes
from tests.conftest import tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this PyTorch has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (2, 5, 48), (0, 48)])
def test_a_prepacked_linear_is_the_plain_product(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(48, 96, bias=bias)
    packed = PrepackedLinear(linear)
    x = torch.randn(*shape)
    got = packed(x)
    assert got.shape == (*shape[:-1], 96) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, reference_linear(x, packed), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.weight, linear.weight)  # the plain matrix comes back exactly


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Verified decoding scores a token in a pass of several columns that next-token decoding scores alone: each
    row of a 64-row call equals the same row computed in calls of 1 to 33 rows, bit for bit."""
    torch.manual_seed(1)
    packed = PrepackedLinear(nn.Linear(96, 640, bias=False))
    x = torch.randn(64, 96)
    full = packed(x)
    for rows in (1, 2, 3, 5, 8, 16, 33):
        assert torch.equal(packed(x[:rows]), full[:rows]), rows


def test_a_tied_model_keeps_its_embedding_and_scores_through_a_packed_copy():
    model = tiny_model(seed=3, vocab_size=80)
    ids = torch.randint(3, 80, (2, 12))
    bytes_before = resident_weight_bytes(model)
    count_before = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        before = model(ids)
        table = model.embed_tokens.weight.clone()
        replaced = prepack_model(model, min_elements=0)
        after = model(ids)
    assert resident_weight_bytes(model) == bytes_before + 80 * model.config.hidden_size * 4  # the head's copy
    assert sum(t.numel() for t in weight_tensors(model)) == count_before  # what a parameter count reports
    linears = sum(isinstance(m, PrepackedLinear) for m in model.modules())
    assert replaced == linears + 1  # every linear, and the tied head's reordered copy
    assert isinstance(model.embed_tokens, nn.Embedding) and torch.equal(model.embed_tokens.weight, table)
    assert all(not p.is_mkldnn for p in model.parameters()) and all(not b.is_mkldnn for b in model.buffers())
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert torch.equal(after.argmax(-1), before.argmax(-1))


def test_prepack_refuses_what_onednn_does_not_take():
    model = tiny_model(seed=3).to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32 weights on a CPU"):
        prepack_model(model, min_elements=0)
    assert not prepack.available("cpu", torch.bfloat16) and not prepack.available("meta", torch.float32)


@pytest.mark.parametrize("arch, tie", [("llama", True), ("qwen2", False)])
def test_llm_prepacks_by_default_and_onednn_false_keeps_the_plain_matmul(tmp_path, monkeypatch, arch, tie):
    """Through ``LLM``: a Llama with a tied head and a Qwen2 with q/k/v biases and its own head, from float32
    GGUFs; the prepacked model's logits equal the plain one's up to float rounding, and greedy text is the same."""
    from tests.models.conftest_gguf import tiny_checkpoint, write_gguf

    monkeypatch.setenv("CELERIS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prepack, "MIN_WEIGHT_ELEMENTS", 0)  # the tiny layers are below the default
    path = write_gguf(tmp_path / f"{arch}.gguf", tiny_checkpoint(arch, tie=tie))
    fast, plain = LLM(str(path), device="cpu"), LLM(str(path), device="cpu", onednn=False)
    assert fast.prepacked > 0 and plain.prepacked == 0
    assert fast.engine_config.onednn and not plain.engine_config.onednn
    assert any(isinstance(m, PrepackedLinear) for m in fast.model.modules())
    assert not any(isinstance(m, PrepackedLinear) for m in plain.model.modules())
    ids = torch.tensor([fast.tokenizer.encode("hello world, the theme of")])
    with torch.no_grad():
        torch.testing.assert_close(fast.model(ids), plain.model(ids), rtol=1e-4, atol=1e-4)
    params = plain.default_params(max_tokens=12, temperature=0.0)
    assert fast.generate(["the theme"], params)[0].token_ids == plain.generate(["the theme"], params)[0].token_ids


def test_layers_below_the_size_floor_keep_f_linear():
    """Only weights of at least ``min_elements`` entries are prepacked (oneDNN's fixed cost per call outweighs the
    layout below); a small tied head keeps ``TransformerLM.logits``; the logits stay the plain model's."""
    plain = tiny_model(seed=6, vocab_size=80)
    model = tiny_model(seed=6, vocab_size=80)
    sizes = {n: m.weight.numel() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    floor = sorted(set(sizes.values()))[-1]  # the largest layers only
    replaced = prepack_model(model, min_elements=floor)
    packed = {n for n, m in model.named_modules() if isinstance(m, PrepackedLinear)}
    assert packed == {n for n, size in sizes.items() if size >= floor} and replaced == len(packed) > 0
    assert "logits" not in model.__dict__  # the tied 80 x 32 head is below the floor
    assert prepack_model(tiny_model(seed=6, vocab_size=80)) == 0  # the default floor: nothing this small
    ids = torch.randint(3, 80, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), plain(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch,tie", [("llama", True), ("qwen2", False)])
def test_a_quantized_model_scores_through_a_prepacked_float_head(tmp_path, monkeypatch, arch, tie):
    """int8/int4 leave the head in float32 (without ``quantize_lm_head``): that head alone is prepacked, and the
    logits equal the same quantized model's through ``F.linear``; a quantized head, or ``onednn=False``, is left
    alone; bfloat16 weights are not prepacked."""
    from tests.models.conftest_gguf import tiny_checkpoint, write_gguf

    monkeypatch.setenv("CELERIS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prepack, "MIN_WEIGHT_ELEMENTS", 0)
    path = write_gguf(tmp_path / f"{arch}.gguf", tiny_checkpoint(arch, tie=tie))
    ids = torch.tensor([[5, 9, 14, 3, 22, 7]])
    for method in ("int8", "int4"):
        packed = LLM(str(path), device="cpu", quantization=method)
        plain = LLM(str(path), device="cpu", quantization=method, onednn=False)
        assert packed.prepacked == 1 and plain.prepacked == 0
        assert [type(m) for m in packed.model.modules() if isinstance(m, PrepackedLinear)] == ([] if tie else
                                                                                            [PrepackedLinear])
        with torch.no_grad():
            torch.testing.assert_close(packed.model(ids), plain.model(ids), rtol=1e-4, atol=1e-4)
    head = LLM(str(path), device="cpu", quantization="int8", quantize_lm_head=True)  # int4 takes no 264-row head
    assert head.prepacked == 0
    assert not any(isinstance(m, PrepackedLinear) for m in head.model.modules())
    assert LLM(str(path), device="cpu", dtype="bfloat16").prepacked == 0


def test_a_prepacked_model_copies_saves_and_loads_as_the_plain_one():
    """``copy.deepcopy``, ``state_dict`` (the plain weights under the nn.Linear names) and ``load_state_dict``
    behave as on the model before prepacking; quantizing a prepacked model is refused in one line."""
    import copy

    from celeris.models.quantize import QuantizationError, quantize_model

    plain = tiny_model(seed=5, vocab_size=80)
    model = tiny_model(seed=5, vocab_size=80)
    want = plain.state_dict()
    prepack_model(model, min_elements=0)
    got = model.state_dict()
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    ids = torch.randint(3, 80, (1, 9))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(twin(ids), model(ids))
        other = tiny_model(seed=6, vocab_size=80)
        twin.load_state_dict(other.state_dict())
        torch.testing.assert_close(twin(ids), other(ids), rtol=1e-4, atol=1e-4)
        assert torch.equal(model(ids), copy.deepcopy(model)(ids))  # the original is untouched by its copy's load
    with pytest.raises(QuantizationError, match="onednn=False"):
        quantize_model(model, "int8")
