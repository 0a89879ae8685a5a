"""Issue 13 over HTTP and through the batch path (``OpenAIServing.respond``): values that cannot finish
are refused with their valid range; a request whose step commits nothing ends with code ``no_progress``
(counted in /metrics) instead of waiting for the time-out; every choice says how it was decoded."""

from __future__ import annotations

import asyncio
import copy

import httpx
import pytest

from celeris.config import EngineConfig
from celeris.engine import Engine
from celeris.serve.app import BackgroundServer, create_app
from celeris.serve.async_engine import AsyncEngine
from celeris.serve.serving import OpenAIServing
from tests.serve.conftest import MODEL_NAME, make_serving
from tests.serve.test_errors import assert_error, post

NEVER_FINISHED = [
    ('{"prompt": "x", "max_tokens": 4, "cfg_scale": 1e308}', "cfg_scale", "[0, 100]"),
    ('{"prompt": "x", "max_tokens": 4, "cfg_scale": Infinity}', "cfg_scale", None),
    ('{"prompt": "x", "max_tokens": 4, "top_p": 1e-50, "temperature": 1}', "top_p", "[1e-06, 1]"),
    ('{"prompt": "x", "max_tokens": 4, "repetition_penalty": 1e-300}', "repetition_penalty", "[0.01, 100]"),
    ('{"prompt": "x", "max_tokens": 4, "repetition_penalty": 1e300}', "repetition_penalty", "[0.01, 100]"),
    ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "cfg_scale": 1e308}', "cfg_scale",
     "[0, 100]"),
]


@pytest.fixture(scope="module")
def server(serve_llm):
    serving = make_serving(serve_llm, request_timeout=20.0)
    with BackgroundServer(create_app(serving)) as srv:
        srv.serving = serving
        yield srv


@pytest.mark.parametrize("body, param, valid", NEVER_FINISHED)
def test_values_that_never_finished_are_a_400_naming_the_range(server, body, param, valid):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    resp = post(server, path, body)
    assert resp.elapsed.total_seconds() < 5
    error = assert_error(resp, 400)
    if valid is not None:  # Infinity may also be refused by the JSON layer, with its own message
        assert error["param"] == param and valid in error["message"], error


@pytest.mark.parametrize("body, param, valid", NEVER_FINISHED)
def test_batch_path_refuses_the_same_values(serve_llm, body, param, valid):
    serving = make_serving(serve_llm)
    serving.start()
    try:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        status, record = asyncio.run(serving.respond(path, body))
    finally:
        serving.stop()
    assert status == 400
    if valid is not None:
        assert record["error"]["param"] == param and valid in record["error"]["message"]


def nan_serving(llm) -> OpenAIServing:
    """A serving layer whose model returns NaN logits: no step can commit a token."""
    model = copy.deepcopy(llm.model)
    real_forward = model.forward
    model.forward = lambda *a, **k: real_forward(*a, **k) * float("nan")
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_waiting=8))
    return OpenAIServing(llm, async_engine=AsyncEngine(engine), served_model_name=MODEL_NAME, request_timeout=20.0)


def test_a_request_that_cannot_progress_ends_with_no_progress(serve_llm):
    serving = nan_serving(serve_llm)
    with BackgroundServer(create_app(serving)) as srv:
        resp = post(srv, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 4, "n": 3})
        assert resp.elapsed.total_seconds() < 5  # not the 20 s time-out
        error = assert_error(resp, 500, code="no_progress")
        assert "committed no token" in error["message"]
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert 'celeris_failed_requests_total{code="no_progress",model="tiny-serve"}' in metrics
        # the slots were freed: a normal-looking request is admitted (and fails the same way) at once
        assert_error(post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 4}), 500, code="no_progress")


def test_choices_say_how_they_were_decoded(server):
    """Item 6: 32 tokens per step is visible in the answer, and usage sums the forward passes."""
    body = {"prompt": "def add(a, b):", "max_tokens": 16, "steps": 2, "block_length": 16, "n": 2, "seed": 0,
            "cache": "dual"}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    for choice in resp["choices"]:
        details = choice["celeris"]
        assert set(details) == {"nfe", "drafter_passes", "steps", "tokens_per_forward", "block_length", "cache",
                                "decoding", "remasking"}
        assert details["drafter_passes"] == 0  # no drafter beside this model
        assert details["block_length"] == 16 and details["cache"] == "dual" and details["decoding"] == "fixed"
        assert details["steps"] == details["nfe"] <= 2
        if choice["finish_reason"] == "length":
            assert details["tokens_per_forward"] == 8.0
    assert resp["usage"]["nfe"] == sum(c["celeris"]["nfe"] for c in resp["choices"])
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "steps": 8, "cfg_scale": 1.0}).json()
    assert chat["choices"][0]["celeris"]["nfe"] == 2 * chat["choices"][0]["celeris"]["steps"]
    assert chat["usage"]["nfe"] == chat["choices"][0]["celeris"]["nfe"]


def test_streamed_denoise_events_use_the_same_names(server):
    import json

    body = {"prompt": "def add(a, b):", "max_tokens": 8, "steps": 8, "stream": True, "stream_mode": "denoise",
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as resp:
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    chunks = [json.loads(x) for x in lines]
    details = [c["choices"][0]["celeris"] for c in chunks if c["choices"]]
    assert details and all({"nfe", "steps", "tokens_per_forward"} <= set(d) for d in details)
    assert [d["steps"] for d in details] == sorted(d["steps"] for d in details)
    assert chunks[-1]["usage"]["nfe"] == details[-1]["nfe"]


def test_mask_text_in_prompts_and_messages_is_text(server, serve_llm):
    """Item 3 over HTTP: the prompt's and the message's special-token strings are counted as the text they are."""
    tok = serve_llm.tokenizer
    resp = httpx.post(f"{server.url}/v1/completions", timeout=30,
                      json={"prompt": "x = <|mask|> + 1", "max_tokens": 4, "steps": 4}).json()
    assert resp["usage"]["prompt_tokens"] == len(tok.encode("x = <|mask|> + 1")) > 6  # 6 with the mask id
    plain = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "a b"}], "max_tokens": 4}).json()
    forged = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                        json={"messages": [{"role": "user", "content": "a<|endoftext|>b"}], "max_tokens": 4}).json()
    assert forged["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 1


def test_end_of_generation_controls_over_http(server, serve_llm):
    """Item 4's vLLM request surface: accepted, and an id outside the vocabulary is a 400 naming it."""
    resp = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "prompt": "def f(x):", "max_tokens": 8, "steps": 8, "ignore_eos": True, "skip_special_tokens": False,
        "include_stop_str_in_output": True, "stop_token_ids": [3], "stop": ["<|endoftext|>"]})
    assert resp.status_code == 200, resp.text
    assert_error(post(server, "/v1/completions", {"prompt": "x", "stop_token_ids": [10**6]}), 400,
                 param="stop_token_ids")


def test_include_stop_str_keeps_the_matched_stop():
    from celeris.text import IncrementalText

    decode = lambda ids: "".join(chr(97 + i) for i in ids)  # noqa: E731 - 0 -> "a", 1 -> "b", ...
    kept, cut = IncrementalText(decode, ["cd"], include_stop=True), IncrementalText(decode, ["cd"])
    for text in (kept, cut):
        text.push([0, 1, 2]), text.push([3, 4])
    assert kept.text == "abcd" and cut.text == "ab" and kept.stopped and cut.stopped
