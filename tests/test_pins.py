"""Token pins: the exact answer tokens of the shipped models and the tiny LLaDA and Dream folders.

Refactors of the sampler, the engine, the registries or the models must not change a single token. Each case
decodes a fixed prompt set (CPU, float32, one intra-op thread) with one decoding setting, through the reference
sampler (``celeris.sampling.generate.generate``; verified decoding through ``generate_verified``) and through the
engine (``LLM.generate``), and compares the answer token ids with ``tests/pins.json``.

``tests/pins.json`` was written once, from the code before the issue-16 refactor, with::

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m tests.test_pins --write

Rewrite it only for a change that is meant to change tokens, and say so in the commit.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from celeris.engine.verified import generate_verified
from celeris.llm import EMBEDDED, LLM
from celeris.reference.masked import generate
from celeris.sampling.params import SamplingParams

PINS = Path(__file__).parent / "pins.json"
PROMPTS = ["def add(a, b):\n", "Hello, how are"]

# setting name -> SamplingParams fields (the answer length is short: the pins guard decoding, not quality)
DIFFUSION = {
    "fixed": {"max_tokens": 16, "steps": 8, "block_length": 8},
    "threshold_dual": {"max_tokens": 16, "steps": 16, "block_length": 8, "decoding": "threshold", "threshold": 0.3,
                       "cache": "dual"},
    "factor_prefix": {"max_tokens": 16, "steps": 16, "block_length": 8, "decoding": "factor", "factor": 2.0,
                      "cache": "prefix"},
    "entropy_dual_delayed": {"max_tokens": 16, "steps": 16, "block_length": 4, "decoding": "entropy",
                             "entropy_bound": 1.0, "cache": "dual_delayed", "cache_refresh": 2},
    "sampled_delayed": {"max_tokens": 16, "steps": 8, "block_length": 4, "temperature": 0.8, "top_p": 0.9,
                        "top_k": 20, "remasking": "margin", "repetition_penalty": 1.3, "seed": 7, "cache": "delayed"},
    "random_window": {"max_tokens": 16, "steps": 8, "block_length": 4, "temperature": 0.5, "seed": 3,
                      "remasking": "random", "cache": "dual_delayed", "suffix_window": 4},
}
CAUSAL = {
    "fixed": {"max_tokens": 12, "steps": 12, "block_length": 1},
    "delayed": {"max_tokens": 12, "steps": 12, "block_length": 1, "cache": "delayed"},
    "sampled_delayed": {"max_tokens": 12, "steps": 12, "block_length": 1, "cache": "delayed", "temperature": 0.9,
                        "top_k": 30, "seed": 11, "repetition_penalty": 1.2},
}
HYBRID = CAUSAL | {
    "verified_slots": {"max_tokens": 12, "decoding": "verified", "draft_source": "slots"},
    "verified_lookup_first": {"max_tokens": 12, "decoding": "verified", "draft_source": "lookup_first"},
}
MODELS = {
    "celeris-code-6m": DIFFUSION, "celeris-code-6m-ar": CAUSAL, "celeris-code-6m-hybrid": HYBRID,
    "llada": DIFFUSION, "dream": DIFFUSION,
}


def make_params(fields: dict) -> SamplingParams:
    """SamplingParams from a case's fields."""
    return SamplingParams(**fields)


def model_folder(name: str, root: Path) -> Path:
    """The checkpoint folder of ``name``: a shipped one, or a tiny LLaDA / Dream folder written under ``root``."""
    if name not in ("llada", "dream"):
        return EMBEDDED / name
    from tests.models.conftest_formats import write_dream, write_llada

    folder = root / name
    if not folder.is_dir():
        (write_llada if name == "llada" else write_dream)(folder, num_shards=1)
    return folder


def decode(llm: LLM, cases: dict[str, dict]) -> dict[str, dict[str, list[list[int]]]]:
    """Per case: the answer ids of the reference sampler ("reference") and of the engine ("engine")."""
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    out = {}
    for case, fields in cases.items():
        params = make_params(fields)
        run = generate_verified if params.decoding == "verified" else generate
        reference = run(llm.model, prompt_ids, params).token_ids
        engine = [o.token_ids for o in llm.generate(prompt_ids, params)]
        out[case] = {"reference": [list(r) for r in reference], "engine": engine}
    return out


def compute_all(root: Path) -> dict:
    """Every model's pins, as ``tests/pins.json`` stores them."""
    torch.set_num_threads(1)
    return {name: decode(LLM(model_folder(name, root), device="cpu", dtype="float32", quantization="none"), cases)
            for name, cases in MODELS.items()}


@pytest.fixture(scope="module")
def pins() -> dict:
    return json.loads(PINS.read_text())


@pytest.mark.parametrize("name", list(MODELS))
def test_tokens_match_the_pins(name: str, pins: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every case's tokens, reference sampler and engine, equal the pinned ones."""
    torch.set_num_threads(1)
    llm = LLM(model_folder(name, tmp_path_factory.mktemp("pins")), device="cpu", dtype="float32", quantization="none")
    got = decode(llm, MODELS[name])
    assert set(got) == set(pins[name])
    for case, paths in got.items():
        assert paths == pins[name][case], f"{name} / {case}: tokens changed"
        assert any(len(row) > 0 for row in paths["engine"]), f"{name} / {case}: empty answers pin nothing"


if __name__ == "__main__" and "--write" in sys.argv:
    with tempfile.TemporaryDirectory() as tmp:
        PINS.write_text(json.dumps(compute_all(Path(tmp)), indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {PINS}")
