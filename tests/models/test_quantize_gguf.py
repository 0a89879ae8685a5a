"""``--quantization gguf``'s int4 / int8 path: a GGUF's Q4_0/Q4_1/Q4_K tensors as group-32 int4 (Q4_1 recovered
exactly), the others and the embedding as int8 rows, the head quantized (tiny GGUFs written here; SmolLM2's in the
slow tier). A module whose tensors are all one of Q4_0 / Q4_1 / Q8_0 keeps the file's blocks instead
(tests/models/test_gguf_quantized.py); here that path is switched off, so these Q4_1 / Q8_0 files take the int path."""

from __future__ import annotations

import pytest
import torch

from celeris.llm import LLM
from celeris.models import gguf_quantized as GQ
from celeris.models.quantize import Int4Linear, Int8Embedding, Int8Linear, QuantizationError, int4_group_quantize
from tests.models.conftest_gguf import tiny_checkpoint, write_gguf

pytest.importorskip("gguf")
QUANT = {"ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_1", "attn_q": "Q4_1", "attn_k": "Q4_1",
         "attn_v": "Q4_1", "attn_output": "Q8_0", "token_embd": "Q8_0"}


@pytest.fixture
def gguf_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CELERIS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(GQ, "BLOCK_TYPES", {})  # no module kept as blocks
    return write_gguf(tmp_path / "llama.gguf", tiny_checkpoint("llama"), quant=QUANT)


def test_block_types_choose_each_layers_width(gguf_file):
    ref = LLM(gguf_file, device="cpu")
    q = LLM(gguf_file, device="cpu", quantization="gguf")
    layers = dict(q.model.named_modules())
    assert isinstance(layers["layers.0.attn.qkv_proj"], Int4Linear)  # q, k, v all Q4_1
    assert isinstance(layers["layers.0.mlp.gate_up_proj"], Int4Linear)
    assert isinstance(layers["layers.0.attn.o_proj"], Int8Linear)  # Q8_0: requantized per channel
    assert isinstance(q.model.embed_tokens, Int8Embedding)
    # Q4_1 blocks are group-32 int4 with scale and minimum: the codes come back exactly from the float weights
    for name in ("layers.0.attn.qkv_proj", "layers.1.mlp.gate_up_proj", "layers.1.mlp.down_proj"):
        w = dict(ref.model.named_modules())[name].weight.detach()
        n, k = w.shape
        codes, scale, zero = int4_group_quantize(w, 32)
        back = ((codes.float().reshape(n, k // 32, 32) - 8) * scale[..., None] + zero[..., None]).reshape(n, k)
        torch.testing.assert_close(back, w, atol=1e-6, rtol=0)
    ids = torch.tensor([ref.tokenizer.encode("hello world")])
    with torch.no_grad():
        p, r = ref.model(ids).log_softmax(-1), q.model(ids).log_softmax(-1)
    assert float((p.exp() * (p - r)).sum(-1).mean()) < 0.05
    assert len(q.generate(["hello"], q.default_params(max_tokens=4))[0].token_ids) > 0


def test_gguf_needs_a_gguf_checkpoint():
    with pytest.raises(QuantizationError, match="--quantization gguf needs a .gguf checkpoint; 'celeris-code-6m' "
                                                "holds float weights"):
        LLM("celeris-code-6m", device="cpu", quantization="gguf")
