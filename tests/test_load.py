"""Loading in named steps (celeris.load): ``--quantization q8_0`` puts any float checkpoint on the CPU's fast pass
(every linear as GGUF Q8_0 blocks on the block kernel, the fast operators switched on) and stays close to the float
model; it refuses a device or a width it cannot take in one clear error."""

from __future__ import annotations

import pytest
import torch

from celeris.llm import LLM
from celeris.load import quantize_to_blocks
from celeris.models import kernels
from celeris.models.blocks import BlockLinear
from celeris.models.quantize import QuantizationError, quantization_of
from tests.conftest import TINY_LLM, tiny_model

needs_kernels = pytest.mark.skipif(kernels.library() is None, reason="no C compiler: the block kernel is off")


@needs_kernels
def test_q8_0_puts_a_float_checkpoint_on_the_block_kernel_close_to_float(tiny_checkpoint):
    plain = LLM(str(tiny_checkpoint), **TINY_LLM)
    q = LLM(str(tiny_checkpoint), **TINY_LLM, quantization="q8_0")
    assert quantization_of(q.model) == "q8_0" and q.quantization["layers"] > 0
    assert not any(type(m) is torch.nn.Linear for m in q.model.modules())
    assert all(isinstance(m, BlockLinear) for n, m in q.model.named_modules() if n.endswith(("qkv_proj", "down_proj")))
    assert all(m.fast for m in q.model.modules() if hasattr(m, "fast"))
    assert q.quantization["weight_bytes_after"] < q.quantization["weight_bytes_before"] / 3  # 34 bytes per 32
    ids = torch.tensor([[5, 9, 11, 7, 3, 20]])
    with torch.no_grad():
        want, got = plain.model(ids), q.model(ids)
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # 8 bits a weight, a scale per 32
    params = q.default_params(max_tokens=8)
    out = q.generate([[5, 9, 11]], params)[0]
    assert out.finish_reason in ("stop", "length") and len(out.token_ids) <= 8


def test_q8_0_refuses_another_device_and_a_width_off_the_blocks():
    model = tiny_model()
    with pytest.raises(QuantizationError, match="runs on the CPU only"):
        quantize_to_blocks(model, torch.device("cuda"))
    odd = torch.nn.Sequential(torch.nn.Linear(48, 8))
    with pytest.raises(QuantizationError, match="q8_0: .*48 input columns are not whole blocks of 32"):
        quantize_to_blocks(odd, torch.device("cpu"))


@needs_kernels
def test_a_checkpoints_own_cpu_quantization_applies_unless_none_is_asked(tiny_checkpoint, tmp_path):
    """A checkpoint folder's ``celeris.json`` without a target (the shipped code models') names its CPU
    quantization: it applies when none is asked, ``none`` keeps the float weights, another method wins; such a
    file is not a drafter pairing (the folder lists as an embedded checkpoint of its own)."""
    import json
    import shutil

    from celeris.models.catalog import read_pairing, read_settings

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, folder)
    (folder / "celeris.json").write_text(json.dumps({"quantization": "q8_0"}))
    assert read_pairing(folder) is None and read_settings(folder) == {"quantization": "q8_0"}
    assert quantization_of(LLM(str(folder), **TINY_LLM).model) == "q8_0"
    plain = LLM(str(folder), **TINY_LLM, quantization="none")
    assert quantization_of(plain.model) is None and not any(isinstance(m, BlockLinear) for m in plain.model.modules())
    assert quantization_of(LLM(str(folder), **TINY_LLM, quantization="int8").model) == "int8"


def test_none_means_the_checkpoints_own_weights_and_takes_no_head_option():
    from celeris.config import EngineConfig

    assert EngineConfig(quantization="none").quantization is None
    with pytest.raises(ValueError, match="quantize_lm_head needs a quantization"):
        EngineConfig(quantization="none", quantize_lm_head=True)


@needs_kernels
def test_the_shipped_code_models_load_as_q8_0_on_a_cpu():
    """The embedded code models load on the block kernel on a CPU (their cards: per pass at least 2.6x 81d587c's
    float32, within int8's quality floors, ``celeris.bench.divergence``); the pins and the divergence reference ask
    for ``none``."""
    for name in ("celeris-code-6m", "celeris-code-6m-hybrid", "celeris-code-6m-ar"):
        llm = LLM(name, device="cpu")
        assert quantization_of(llm.model) == "q8_0", name
        assert all(m.fast for m in llm.model.modules() if hasattr(m, "fast")), name


def test_none_keeps_a_drafters_float_weights_and_is_no_bench_width():
    """``speculative_config`` ``quantization`` ``none``: the drafter's own float weights (not the target's method);
    the bench's width list refuses ``none`` (float32 is that width)."""
    from celeris.bench.quantized import parse_widths
    from celeris.sampling.drafter import SpeculativeConfig

    spec = SpeculativeConfig.parse({"method": "dflash", "model": "x", "quantization": "none"})
    assert spec.quantization == "none"
    with pytest.raises(ValueError):
        parse_widths("none")
