"""celeris.sampling.modes: the mode each model and request takes, one check per mode, and the draft settings
checked the same way at admission (check_verified_support) and by the verified decoder itself."""

from __future__ import annotations

import itertools

import pytest
import torch

from celeris.engine.verified import VerifiedDecoder
from celeris.models.contract import CONTRACTS
from celeris.sampling.drafter import DFlashProposer, attach
from celeris.sampling.modes import MODES, check_request, mode_of
from celeris.sampling.params import SamplingParams
from celeris.sampling.verified import check_verified_support
from tests.conftest import tiny_model
from tests.sampling.test_drafter import drafter_for


class PublishedBlockModel(torch.nn.Module):
    """What the checks read of a published block-diffusion model (SDAR): a block-causal contract, no causal flag."""

    block_contract = CONTRACTS["sdar"]
    supports_kv_cache = True

    def __init__(self) -> None:
        super().__init__()
        self.config = tiny_model().config


@pytest.fixture(scope="module")
def models():
    return {"diffusion": tiny_model(), "causal": tiny_model(is_causal=True), "sdar": PublishedBlockModel(),
            "hybrid": tiny_model(is_causal=True, draft_block_size=4)}


@pytest.mark.parametrize("name, settings, mode", [
    ("diffusion", {}, "masked"),
    ("causal", {"block_length": 1, "cache": "delayed"}, "masked"),  # next-token decoding through the masked path
    ("hybrid", {"block_length": 1}, "masked"),
    ("hybrid", {"block_length": 4}, "block"),  # a hybrid asking for blocks
    ("hybrid", {"decoding": "verified"}, "verified"),
    ("hybrid", {"decoding": "verified", "block_length": 4}, "verified"),  # verified wins over blocks
    ("causal", {"decoding": "verified", "draft_source": "lookup"}, "verified"),
    ("sdar", {"block_length": 4}, "block"),
])
def test_each_model_and_request_takes_one_mode_and_passes_its_check(models, name, settings, mode):
    params = SamplingParams(**settings)
    assert mode in MODES
    assert mode_of(models[name], params) == mode
    assert check_request(models[name], params) == mode


@pytest.mark.parametrize("name, settings, word", [
    ("sdar", {"decoding": "verified", "block_length": 4}, "decoding"),  # a published block model always denoises blocks
    ("sdar", {"block_length": 4, "cfg_scale": 1.0}, "cfg_scale"),
    ("causal", {"block_length": 2}, "block_length"),
    ("causal", {"decoding": "verified"}, "draft_source"),  # no mask slots: lookup only
    ("diffusion", {"decoding": "verified"}, "decoding"),  # not causal
    ("hybrid", {"decoding": "verified", "cfg_scale": 1.0}, "cfg_scale"),
])
def test_what_the_mode_cannot_run_is_refused_naming_the_setting_first(models, name, settings, word):
    with pytest.raises(ValueError, match=f"^{word}"):
        check_request(models[name], SamplingParams(**settings))


def test_stop_token_ids_must_be_in_the_vocabulary_the_caller_names(models):
    model = models["diffusion"]
    vocab = model.config.vocab_size
    assert check_request(model, SamplingParams(stop_token_ids=[vocab - 1])) == "masked"
    with pytest.raises(ValueError, match=f"stop_token_ids must be ids below the vocabulary size {vocab}"):
        check_request(model, SamplingParams(stop_token_ids=[vocab]))
    with pytest.raises(ValueError, match="below the vocabulary size 10"):  # the serving layer's tokenizer vocabulary
        check_request(model, SamplingParams(stop_token_ids=[vocab - 1]), vocab_size=10)


DRAFT_SETTINGS = [{"draft_source": s, "num_speculative_tokens": k}
                  for s, k in itertools.product(("lookup_first", "slots", "lookup", "dflash"), (None, 2, 4, 6))]


def _refusal(check, *args) -> str | None:
    try:
        check(*args)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("target", ["hybrid", "causal", "causal+drafter", "hybrid+drafter"])
def test_admission_and_the_verified_decoder_refuse_the_same_draft_settings(models, target):
    """One check of the draft settings: for every draft source and count, the admission check and
    ``VerifiedDecoder.add`` (which direct callers use without admission) refuse the same requests with the same
    message, on a hybrid, a plain causal model and each of them with a DFlash drafter (block 5: 1..4 drafts)."""
    model = tiny_model(seed=5, is_causal=True, draft_block_size=4 if target.startswith("hybrid") else 0)
    attach(model, DFlashProposer(drafter_for(model), model) if target.endswith("drafter") else None)
    refused = 0
    for settings in DRAFT_SETTINGS:
        params = SamplingParams(decoding="verified", max_tokens=4, **settings)
        at_admission = _refusal(check_verified_support, model, params)
        in_decoder = _refusal(VerifiedDecoder(model, 1, 16, prefix_cache_tokens=0).add, [3, 4, 5], params)
        assert at_admission == in_decoder, settings
        refused += at_admission is not None
    assert 0 < refused < len(DRAFT_SETTINGS)  # the grid holds both kinds
