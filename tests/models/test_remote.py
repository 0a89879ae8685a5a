"""The registry's dispatch, and the generic trust_remote_code backend on a folder that ships its own modeling code.

The remote folder is written here: ``configuration_tiny.py`` and
``modeling_tiny.py`` (a minimal ``PretrainedConfig`` / ``PreTrainedModel``
pair named in config.json's ``auto_map``), safetensors weights under the
model's own parameter names, and tokenizer files. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest
import torch

from celeris.models.celeris import CelerisModel
from celeris.models.loader import CheckpointError, detect_format, load_any
from celeris.reference.masked import generate
from celeris.sampling.params import SamplingParams
from tests.models.conftest_formats import save_weights, write_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "transformers" not in sys.modules:  # keep the copied modeling code out of ~/.cache
    os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="celeris-hf-modules-"))

CONFIGURATION = '''
from transformers import PretrainedConfig


class TinyDenoiserConfig(PretrainedConfig):
    model_type = "tiny-denoiser"

    def __init__(self, vocab_size=64, hidden_size=16, max_position_embeddings=64, mask_token_id=1, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.max_position_embeddings = max_position_embeddings
        self.mask_token_id = mask_token_id
        super().__init__(**kwargs)
'''

MODELING = '''
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

from .configuration_tiny import TinyDenoiserConfig


class TinyDenoiser(PreTrainedModel):
    """Each position sees itself plus the mean of all real positions (bidirectional)."""

    config_class = TinyDenoiserConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.mix = nn.Linear(config.hidden_size, config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, **kwargs):
        h = self.embed(input_ids)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        w = attention_mask[..., None].to(h.dtype)
        context = (h * w).sum(1, keepdim=True) / w.sum(1, keepdim=True)
        return MaskedLMOutput(logits=self.head(torch.tanh(self.mix(h + context))))
'''


def write_remote(folder, drop_pad: bool = True) -> tuple[dict, dict]:
    ids = write_tokenizer(folder, [], {"eos_token": "<|endoftext|>", "pad_token": {"content": "<|pad|>"},
                                      "mask_token": "<|mask|>", "tokenizer_class": "PreTrainedTokenizerFast"})
    vocab, hidden = ids["__size__"], 16
    config = {
        "architectures": ["TinyDenoiser"], "model_type": "tiny-denoiser",
        "auto_map": {"AutoConfig": "configuration_tiny.TinyDenoiserConfig",
                     "AutoModelForMaskedLM": "modeling_tiny.TinyDenoiser"},
        "vocab_size": vocab, "hidden_size": hidden, "max_position_embeddings": 64,
        "mask_token_id": ids["<|mask|>"], "eos_token_id": ids["<|endoftext|>"], "torch_dtype": "float32",
    }
    if not drop_pad:
        config["pad_token_id"] = ids["<|pad|>"]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "configuration_tiny.py").write_text(CONFIGURATION)
    (folder / "modeling_tiny.py").write_text(MODELING)
    g = torch.Generator().manual_seed(0)
    state = {"embed.weight": torch.randn(vocab, hidden, generator=g), "mix.weight": torch.randn(hidden, hidden, generator=g),
             "mix.bias": torch.randn(hidden, generator=g), "head.weight": torch.randn(vocab, hidden, generator=g),
             "head.bias": torch.randn(vocab, generator=g)}
    save_weights(folder, state)
    return config | {"pad_token_id": ids["<|pad|>"]}, state


def remote_reference(state: dict, ids: torch.Tensor, key_ok: torch.Tensor) -> torch.Tensor:
    w = {k: v.double() for k, v in state.items()}
    h = w["embed.weight"][ids]  # (B, L, H)
    weights = key_ok[..., None].double()
    context = (h * weights).sum(1, keepdim=True) / weights.sum(1, keepdim=True)
    mixed = torch.tanh((h + context) @ w["mix.weight"].T + w["mix.bias"])
    return mixed @ w["head.weight"].T + w["head.bias"]


@pytest.fixture
def remote_dir(tmp_path):
    folder = tmp_path / f"tiny_remote_{tmp_path.name}"  # a fresh module name for transformers per test
    config, state = write_remote(folder)
    return folder, config, state


def test_detect_format():
    assert detect_format({"model_type": "celeris"}) == "celeris"
    assert detect_format({"model_type": "llada"}) == "llada"
    assert detect_format({"architectures": ["LLaDAModelLM"]}) == "llada"
    assert detect_format({"model_type": "Dream"}) == "dream"
    assert detect_format({"architectures": ["DreamModel"]}) == "dream"
    assert detect_format({"model_type": "tiny-denoiser"}) is None


def test_celeris_folder_goes_to_the_celeris_loader(tiny_checkpoint, monkeypatch):
    from celeris.models import loader

    assert isinstance(load_any(tiny_checkpoint), CelerisModel)
    monkeypatch.setattr(loader, "available_bytes", lambda device: 1)
    with pytest.raises(CheckpointError, match="not enough memory"):
        load_any(tiny_checkpoint)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_any(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_any(tmp_path)


def test_unknown_format_is_refused_without_trust_remote_code(remote_dir):
    folder, _, _ = remote_dir
    with pytest.raises(CheckpointError) as info:
        load_any(folder)
    message = str(info.value)
    assert "tiny-denoiser" in message
    for name in ("celeris", "llada", "dream", "trust_remote_code"):
        assert name in message


def test_remote_code_backend(remote_dir):
    pytest.importorskip("transformers", reason="the trust_remote_code backend runs models through transformers")
    from celeris.models.remote import RemoteModel

    folder, config, state = remote_dir
    model = load_any(folder, trust_remote_code=True)
    assert isinstance(model, RemoteModel)
    assert (model.config.mask_token_id, model.config.eos_token_id) == (config["mask_token_id"], config["eos_token_id"])
    assert model.config.pad_token_id == config["pad_token_id"]  # not in config.json: from tokenizer_config.json
    assert model.config.max_position_embeddings == 64
    ids = torch.randint(3, config["vocab_size"], (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :2] = False
    with torch.no_grad():
        got = model(ids, mask)
        assert got.dtype == torch.float32
        assert (got - remote_reference(state, ids, mask))[mask].abs().max() < 1e-4
        assert torch.allclose(model(ids, mask, logits_slice=slice(3, 6)), got[:, 3:6])
    out = generate(model, [[5, 6, 7], [8]], SamplingParams(max_tokens=4, steps=4, block_length=4,
                                                          early_exit=False, cfg_scale=0.5))
    assert out.answer_ids.shape == (2, 4) and not (out.answer_ids == config["mask_token_id"]).any()


def test_llm_with_trust_remote_code(remote_dir):
    pytest.importorskip("transformers", reason="the trust_remote_code backend runs models through transformers")
    from celeris.llm import LLM

    folder, _, _ = remote_dir
    with pytest.raises(CheckpointError, match="trust_remote_code"):
        LLM(folder, device="cpu")
    llm = LLM(folder, device="cpu", trust_remote_code=True)
    outs = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=4, steps=4, block_length=4))
    assert len(outs) == 1 and isinstance(outs[0].text, str)
