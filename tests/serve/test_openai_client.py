"""The live server driven by the official ``openai`` client: completions, chat, streaming, n, stop, seeds,
infilling, extension parameters; answers checked against the offline ``LLM.generate``."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.serve.conftest import MODEL_NAME

PROMPT = "def fibonacci(n):"
SAMPLED = {"temperature": 1.0, "max_tokens": 16}


def offline(llm, prompt: str, suffix: str | None = None, **overrides) -> str:
    params = llm.default_params(**overrides)
    return llm.generate(prompt, params, suffixes=[suffix])[0].text


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_models_lists_the_served_model(client, serve_llm):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra.get("max_model_len") == serve_llm.context_length


def test_models_retrieve(client):
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("other-model")
    assert info.value.body["code"] == "model_not_found"


def test_completion_matches_offline_generate(client, serve_llm):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, seed=11, **SAMPLED)
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == MODEL_NAME
    assert choice.text == offline(serve_llm, PROMPT, max_tokens=16, temperature=1.0, seed=11)
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == len(serve_llm.tokenizer.encode(PROMPT))
    assert 0 < out.usage.completion_tokens <= 16
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_extension_parameters_reach_the_engine(client, serve_llm):
    extra = {"steps": 4, "block_length": 4, "remasking": "random", "decoding": "threshold", "threshold": 0.5,
             "cfg_scale": 1.0, "cache": "none"}
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, seed=5, extra_body=extra, **SAMPLED)
    overrides = {k: v for k, v in extra.items() if k != "cache"}
    assert out.choices[0].text == offline(serve_llm, PROMPT, max_tokens=16, temperature=1.0, seed=5, **overrides)


def test_seed_reproducibility(client):
    texts = [client.completions.create(model=MODEL_NAME, prompt=PROMPT, seed=s, **SAMPLED).choices[0].text
             for s in (3, 3, 4)]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]


def test_n_returns_n_choices_with_consecutive_seeds(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=2, seed=7, **SAMPLED)
    assert [c.index for c in out.choices] == [0, 1]
    singles = [client.completions.create(model=MODEL_NAME, prompt=PROMPT, seed=s, **SAMPLED).choices[0].text
               for s in (7, 8)]
    assert [c.text for c in out.choices] == singles
    assert out.usage.completion_tokens <= 32


def test_prompt_list_gives_one_choice_per_prompt_and_n(client, serve_llm):
    prompts = [PROMPT, "import os"]
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, seed=1, **SAMPLED)
    assert len(out.choices) == 4
    assert out.usage.prompt_tokens == sum(len(serve_llm.tokenizer.encode(p)) for p in prompts)


def test_chat_completion_uses_the_chat_template(client, serve_llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "write add"}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, seed=2, temperature=1.0,
                                         max_completion_tokens=12)
    prompt = serve_llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == offline(serve_llm, prompt, max_tokens=12, temperature=1.0, seed=2)
    assert out.usage.prompt_tokens == len(serve_llm.tokenizer.encode(prompt))
    assert out.usage.completion_tokens <= 12


def test_stop_as_string_and_as_list(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, seed=21, **SAMPLED).choices[0].text
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    expected = full[: full.find(stop)]
    for form in (stop, ["never-appears", stop]):
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, seed=21, stop=form, **SAMPLED)
        assert out.choices[0].text == expected
        assert out.choices[0].finish_reason == "stop"
        assert out.usage.completion_tokens < 16
    chunks = client.completions.create(model=MODEL_NAME, prompt=PROMPT, seed=21, stop=[stop], stream=True, **SAMPLED)
    pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks]
    assert "".join(t for t, _ in pieces) == expected
    assert pieces[-1][1] == "stop"


@pytest.mark.parametrize("seed", [31, 32])
def test_streamed_deltas_equal_the_full_text(client, seed):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, seed=seed, **SAMPLED)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, seed=seed, stream=True,
                                            stream_options={"include_usage": True}, **SAMPLED))
    text_chunks, usage_chunks = chunks[:-1], chunks[-1:]
    deltas = [c.choices[0].text for c in text_chunks]
    assert "".join(deltas) == full.choices[0].text
    assert all(not d.endswith("\ufffd") for d in deltas[:-1])  # no character split across chunks
    assert text_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunks[0].choices == [] and usage_chunks[0].usage == full.usage
    assert all(c.usage is None for c in text_chunks)


def test_chat_stream_equals_chat_text_and_sends_role_first(client):
    kwargs = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "seed": 4, "temperature": 1.0,
              "max_tokens": 16, "n": 2}
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    for i in range(2):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
        assert text == full.choices[i].message.content
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].index == i and c.choices[0].finish_reason]
        assert finishes == [full.choices[i].finish_reason]


def test_stream_wire_format_usage_once_then_done(server):
    body = {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 8}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert sum(p.get("usage") is not None for p in payloads) == 1
    assert payloads[-1]["usage"]["completion_tokens"] <= 8 and payloads[-1]["choices"] == []
    without = {"prompt": PROMPT, "stream": True, "max_tokens": 8}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=without, timeout=30) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]" and all(json.loads(e).get("usage") is None for e in events[:-1])


def test_infilling_with_suffix(client, serve_llm):
    suffix = "\n    return result\n"
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, suffix=suffix, seed=9, **SAMPLED)
    assert out.choices[0].text == offline(serve_llm, PROMPT, suffix, max_tokens=16, temperature=1.0, seed=9)
    assert out.choices[0].text != offline(serve_llm, PROMPT, max_tokens=16, temperature=1.0, seed=9)
    tok = serve_llm.tokenizer
    assert out.usage.prompt_tokens == len(tok.encode(PROMPT)) + len(tok.encode(suffix))


def test_denoise_stream_mode_sends_the_canvas_every_step(server):
    body = {"prompt": PROMPT, "stream": True, "stream_mode": "denoise", "max_tokens": 8, "steps": 8,
            "block_length": 8, "seed": 1, "temperature": 1.0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as resp:
        payloads = [json.loads(e) for e in sse_events(resp)[:-1]]
    full = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False, "stream_mode": "text"},
                      timeout=30).json()
    steps = [p["choices"][0]["step"] for p in payloads]
    assert steps == sorted(steps) and len(payloads) >= 2
    assert "\u2591" in payloads[0]["choices"][0]["text"]  # masked positions are shown
    assert payloads[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert payloads[-1]["choices"][0]["text"] == full["choices"][0]["text"]


def test_health_and_metrics(server, client):
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4)
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server.url}/metrics").text
    assert 'celeris_http_requests_total{path="/v1/completions",status="200"}' in text
    for name in ("celeris_time_to_first_token_seconds_count", "celeris_e2e_request_latency_seconds_count",
                 "celeris_output_tokens_total", "celeris_request_nfe_count", "celeris_num_requests_waiting",
                 "celeris_num_requests_running"):
        assert name in text
    count = next(line for line in text.splitlines() if line.startswith("celeris_request_nfe_count"))
    assert float(count.split()[-1]) >= 1
