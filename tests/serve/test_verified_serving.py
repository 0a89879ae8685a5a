"""A hybrid model behind the OpenAI server: verified decoding (the model's default) answers, streams
and counts drafts in /metrics; its text equals the model's next-token decoding."""

from __future__ import annotations

import json

import httpx
import pytest

from celeris.llm import LLM
from celeris.sampling.params import SamplingParams
from celeris.serve.app import BackgroundServer, create_app
from tests.conftest import build_tiny_checkpoint
from tests.serve.conftest import CONTEXT, TEXTS, make_serving


@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory):
    folder = build_tiny_checkpoint(tmp_path_factory.mktemp("hybrid"), TEXTS, "tiny-hybrid", CONTEXT,
                                   {"max_tokens": 12, "temperature": 0.0, "decoding": "verified"}, is_causal=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "draft_block_size": 3}))
    llm = LLM(folder, device="cpu")
    serving = make_serving(llm)
    with BackgroundServer(create_app(serving)) as srv:
        srv.llm, srv.engine = llm, serving.async_engine.engine
        yield srv


def test_verified_completion_equals_next_token_decoding_and_is_counted(hybrid_server):
    import openai

    client = openai.OpenAI(base_url=f"{hybrid_server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    llm = hybrid_server.llm
    assert llm.default_params().decoding == "verified"
    prompt = "def fibonacci(n):"
    next_token = llm.generate(prompt, llm.default_params(decoding="fixed", early_exit=True))[0].text
    r = client.completions.create(model="tiny-serve", prompt=prompt, max_tokens=12)
    assert r.choices[0].text == next_token
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-serve", prompt=prompt, max_tokens=12, stream=True) if c.choices)
    assert streamed == next_token
    one = client.completions.create(model="tiny-serve", prompt=prompt, max_tokens=12,
                                    extra_body={"num_speculative_tokens": 1, "draft_source": "slots"})
    assert one.choices[0].text == next_token  # vLLM's name for k: fewer drafts per pass, the same greedy text
    penalized = llm.generate(prompt, llm.default_params(decoding="fixed", early_exit=True,
                                                          repetition_penalty=2.0))[0].text
    r = client.completions.create(model="tiny-serve", prompt=prompt, max_tokens=12,
                                  extra_body={"repetition_penalty": 2.0})
    assert r.choices[0].text == penalized != next_token  # verified decoding keeps the penalized next-token text
    penalized = llm.generate(prompt, llm.default_params(decoding="fixed", early_exit=True, frequency_penalty=1.5,
                                                          presence_penalty=0.5))[0].text
    r = client.completions.create(model="tiny-serve", prompt=prompt, max_tokens=12, frequency_penalty=1.5,
                                  presence_penalty=0.5)  # OpenAI's own parameters
    assert r.choices[0].text == penalized != next_token
    dry = {"dry_multiplier": 2.0, "dry_allowed_length": 1, "dry_sequence_breakers": []}  # DRY, llama.cpp's names
    penalized = llm.generate(prompt, llm.default_params(decoding="fixed", early_exit=True, **dry))[0].text
    r = client.completions.create(model="tiny-serve", prompt=prompt, max_tokens=12, extra_body=dry)
    assert r.choices[0].text == penalized != next_token
    metrics = httpx.get(f"{hybrid_server.url}/metrics").text
    drafted = [line for line in metrics.splitlines() if line.startswith("celeris_spec_decode_num_draft_tokens_total")]
    assert drafted and float(drafted[0].split()[-1]) > 0
    assert 'celeris_spec_decode_num_accepted_tokens_per_pos_total{model="tiny-serve",position="1"}' in metrics
    queries = hybrid_server.engine.drafter.prefix_cache.query_tokens
    assert queries >= 3 * len(llm.tokenizer.encode(prompt))  # each verified request's prompt was looked up
    assert f'celeris_prefix_cache_queries_total{{model="tiny-serve"}} {float(queries)}' in metrics
    assert 'celeris_prefix_cache_hits_total{model="tiny-serve"}' in metrics


def test_verified_refuses_settings_it_cannot_honour(hybrid_server):
    r = httpx.post(f"{hybrid_server.url}/v1/completions",
                   json={"prompt": "x = 1", "max_tokens": 4, "decoding": "verified", "cfg_scale": 1.0})
    assert r.status_code == 400 and "cfg_scale" in r.json()["error"]["message"]
    r = httpx.post(f"{hybrid_server.url}/v1/completions",
                   json={"prompt": "x = 1", "max_tokens": 4, "decoding": "verified", "draft_source": "slots",
                         "num_speculative_tokens": 4})  # the model drafts 3 mask slots
    assert r.status_code == 400 and r.json()["error"]["param"] == "num_speculative_tokens"
    with pytest.raises(ValueError, match="cfg_scale"):
        hybrid_server.llm.generate("x", SamplingParams(max_tokens=4, block_length=1, decoding="verified",
                                                        cfg_scale=1.0))


def test_denoise_stream_shows_drafts_apart_from_accepted_tokens(hybrid_server):
    """Each pass commits the accepted prefix of the drafts the previous chunk showed, plus one token."""
    body = {"prompt": "def fibonacci(n):", "max_tokens": 12, "stream": True, "stream_mode": "denoise",
            "draft_source": "slots"}
    with httpx.stream("POST", f"{hybrid_server.url}/v1/completions", json=body, timeout=30) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    details = [c["choices"][0]["celeris"] for c in chunks]
    assert details[0]["decoding"] == "verified" and any(d["drafts"] for d in details)
    for before, after in zip(details, details[1:], strict=False):
        start = before["tokens"].index(None) if None in before["tokens"] else len(before["tokens"])
        new = [t for t in after["tokens"][start:] if t is not None]
        # every committed token but the pass's own last one is an accepted draft (compared as text)
        assert 1 <= len(new) <= len(before["drafts"]) + 1 and new[:-1] == before["drafts"][: len(new) - 1]
        assert set(after["token_steps"][start:start + len(new)]) <= {after["steps"]}
