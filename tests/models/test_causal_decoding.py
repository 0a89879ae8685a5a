"""A Llama folder written by transformers decodes through Celeris as the autoregressive twin does, with
transformers' greedy ``generate`` as the oracle: next-token decoding, verified decoding with prompt lookup,
prefix caching, structured output and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from celeris.cli import main
from celeris.llm import LLM
from celeris.structured.grammar import llg, schema_grammar
from tests.models.conftest_causal import tiny_causal

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], list(range(20, 60))]  # ragged lengths, one repeats itself
N = 12


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama") / "tiny-llama"
    hf = tiny_causal("llama", folder, tie_word_embeddings=True)
    return folder, hf, LLM(folder, max_num_seqs=4)


def hf_greedy(hf, prompt: list[int], n: int, stop_at_eos: bool) -> list[int]:
    """transformers' greedy ``generate``; without the end id (``ignore_eos``) when ``stop_at_eos`` is False."""
    eos = hf.generation_config.eos_token_id
    hf.generation_config.eos_token_id = eos if stop_at_eos else None
    try:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=eos)
    finally:
        hf.generation_config.eos_token_id = eos
    ids = out[0, len(prompt):].tolist()
    return ids[: ids.index(eos)] if stop_at_eos and eos in ids else ids


@pytest.mark.parametrize("decoding", ["next-token", "verified"])
@pytest.mark.parametrize("stop_at_eos", [False, True])
def test_greedy_batch_equals_transformers_generate(llama, decoding, stop_at_eos):
    folder, hf, llm = llama
    extra = {"decoding": "verified", "draft_source": "lookup"} if decoding == "verified" else {}
    params = llm.default_params(max_tokens=N, temperature=0.0, ignore_eos=not stop_at_eos, **extra)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, N, stop_at_eos)
    if decoding == "verified" and not stop_at_eos:  # prompt lookup did draft (the repeating prompt)
        assert sum(llm.engine.drafter.drafted) > 0
        assert outs[0].nfe < N


def test_verified_prefix_cache_hit_gives_the_same_tokens(llama):
    folder, hf, llm = llama
    shared = list(range(30, 70))  # two full prefix-cache blocks
    params = llm.default_params(max_tokens=6, temperature=0.0, ignore_eos=True, decoding="verified",
                                draft_source="lookup")
    first = llm.generate([shared + [7]], params)[0].token_ids
    cache = llm.engine.drafter.prefix_cache
    hits = cache.hit_tokens
    second = llm.generate([shared + [8]], params)[0].token_ids
    assert first == hf_greedy(hf, shared + [7], 6, False) and second == hf_greedy(hf, shared + [8], 6, False)
    assert cache.hit_tokens - hits == 32  # the second prompt's two full blocks came from the cache


@pytest.mark.skipif(llg is None, reason="llguidance is not installed")
def test_structured_output_validates(llama):
    folder, hf, llm = llama
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    for extra in ({}, {"decoding": "verified", "draft_source": "lookup"}):
        params = llm.default_params(max_tokens=16, temperature=0.0, grammar=schema_grammar(schema), **extra)
        out = llm.generate([[5, 6, 7]], params)[0]
        assert 0 <= json.loads(out.text)["n"] <= 9


def test_chat_template_from_chat_template_jinja(llama):
    folder, hf, llm = llama
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert llm.tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>user\nhi<|im_end|>")


def test_cli_generate_on_the_folder(llama, capsys):
    folder, hf, llm = llama
    assert main(["generate", "def add(a, b):", "--model", str(folder), "--max-tokens", "6", "--temperature", "0",
                 "--ignore-eos", "--json", "--threads", "1"]) == 0
    record = json.loads(capsys.readouterr().out)
    prompt = llm.tokenizer.encode("def add(a, b):")
    assert record["token_ids"] == hf_greedy(hf, prompt, 6, False) and record["block_length"] == 1


@pytest.mark.slow  # the bench draws its plots (matplotlib)
def test_bench_runs_the_next_token_systems(llama, tmp_path):
    from celeris.bench.run import BenchConfig, run_bench
    from tests.bench.test_run import write_prompts

    folder, hf, llm = llama
    prompts = tmp_path / "he.jsonl"
    write_prompts(prompts)
    results = run_bench(BenchConfig(model=str(folder), lengths=[8], batch_sizes=[1, 2], num_prompts=3, warmup=0,
                                    prompts=str(prompts), out_dir=str(tmp_path / "out"), smollm2=False))
    runs = [r for r in results["runs"] if "system" in r]
    assert {r["system"] for r in runs} == {"ar-reference", "ar-engine", "ar-lookup"}
    assert any(r["output_tokens"] for r in runs)
    assert all(r["agreement_with_reference"] == 1.0 for r in runs if r["output_tokens"])  # all greedy, one model


@pytest.mark.parametrize(("generation", "temperature"), [({"temperature": 0.7, "top_p": 0.8}, 0.0),
                                                         ({"do_sample": True, "temperature": 0.7}, 0.7)])
def test_generation_config_samples_only_with_do_sample(tmp_path, generation, temperature):
    hf = tiny_causal("qwen2", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": hf.config.eos_token_id,
                                                                 **generation}))
    llm = LLM(tmp_path)
    params = llm.default_params(max_tokens=4)
    assert params.temperature == temperature and params.block_length == 1 and params.cache == "delayed"


def test_repetition_penalty_equals_transformers(llama):
    folder, hf, llm = llama
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    out = llm.generate([prompt], llm.default_params(max_tokens=N, temperature=0.0, ignore_eos=True,
                                                    repetition_penalty=1.5))[0]
    eos = hf.generation_config.eos_token_id
    hf.generation_config.eos_token_id = None
    try:
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False, repetition_penalty=1.5,
                          pad_token_id=eos)[0, len(prompt):].tolist()
    finally:
        hf.generation_config.eos_token_id = eos
    assert out.token_ids == ref != hf_greedy(hf, prompt, N, False)  # and the penalty changed the answer
