"""The serving layer without HTTP (what batch jobs reuse), the engine loop, and the load-test script."""

from __future__ import annotations

import asyncio
import json

import pytest

from celeris.bench import loadtest
from celeris.serve.protocol import APIError, CompletionRequest
from tests.serve.conftest import MODEL_NAME, make_serving


@pytest.fixture
def serving(serve_llm):
    serving = make_serving(serve_llm)
    serving.start()
    yield serving
    serving.stop()


def test_run_sync_returns_the_openai_body(serving, serve_llm):
    body = serving.run_sync("/v1/completions", {"model": MODEL_NAME, "prompt": "import os", "max_tokens": 8,
                                                "temperature": 1.0, "seed": 3})
    assert body["object"] == "text_completion"
    expected = serve_llm.generate("import os", serve_llm.default_params(max_tokens=8, temperature=1.0, seed=3))
    assert body["choices"][0]["text"] == expected[0].text
    assert body["usage"]["completion_tokens"] == len(expected[0].token_ids)
    chat = serving.run_sync("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat["choices"][0]["message"]["role"] == "assistant"


def test_respond_maps_failures_to_status_and_error_body(serving):
    status, body = asyncio.run(serving.respond("/v1/completions", {"prompt": ""}))
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body = asyncio.run(serving.respond("/v1/completions", {"prompt": "x", "stream": True}))
    assert status == 400 and body["error"]["param"] == "stream"
    status, body = asyncio.run(serving.respond("/v1/embeddings", {"input": "x"}))
    assert status == 404
    with pytest.raises(APIError) as info:
        serving.run_sync("/v1/completions", '{"prompt": "x", "max_tokens": 0}')
    assert info.value.status_code == 400 and info.value.param == "max_tokens"


def test_autoregressive_twin_is_served_and_refuses_diffusion_only_settings(tmp_path):
    """A causal checkpoint behind the same API: its defaults decode token by token (the offline result);
    blocks longer than one token and a suffix are 400s naming the parameter."""
    from celeris.llm import LLM
    from celeris.serve.serving import OpenAIServing
    from celeris.train.loop import AR_GENERATION
    from tests.conftest import build_tiny_checkpoint
    from tests.serve.conftest import CONTEXT, TEXTS

    folder = build_tiny_checkpoint(tmp_path, TEXTS, "twin", CONTEXT, {**AR_GENERATION, "max_tokens": 8},
                                   is_causal=True)
    llm = LLM(folder, device="cpu")
    serving = OpenAIServing(llm, served_model_name="twin")
    serving.start()
    try:
        body = serving.run_sync("/v1/completions", {"prompt": "import os", "max_tokens": 8})
        expected = llm.generate("import os", llm.default_params(max_tokens=8))[0]
        assert body["choices"][0]["text"] == expected.text and expected.nfe == min(len(expected.token_ids) + 1, 8)
        for extra, param in (({"block_length": 4}, "block_length"), ({"suffix": "x = 1"}, "suffix"),
                             ({"cfg_scale": 1.0}, "cfg_scale"), ({"cache": "dual"}, "cache")):
            status, body = asyncio.run(serving.respond("/v1/completions", {"prompt": "import os", **extra}))
            assert status == 400 and body["error"]["param"] == param, body
    finally:
        serving.stop()


def test_from_model_drives_the_llms_own_engine(serve_checkpoint):
    """One engine per loaded model: the serving layer of ``from_model`` steps ``llm.engine`` with its limits."""
    from celeris.serve.serving import OpenAIServing

    serving = OpenAIServing.from_model(serve_checkpoint, device="cpu", max_num_seqs=3, max_waiting=5)
    assert serving.async_engine.engine is serving.llm.engine
    assert (serving.llm.engine.config.max_num_seqs, serving.llm.engine.config.max_waiting) == (3, 5)
    serving.start()
    try:
        text = serving.run_sync("/v1/completions", {"prompt": "def f(x):", "max_tokens": 8})["choices"][0]["text"]
    finally:
        serving.stop()
    # the loop has stopped: the same engine, driven offline, gives the same answer
    assert serving.llm.generate("def f(x):", serving.llm.default_params(max_tokens=8))[0].text == text


def test_stream_iterator_without_http(serving):
    async def collect():
        request = CompletionRequest.model_validate_json('{"prompt": "def f():", "max_tokens": 8, "stream": true}')
        chunks = await serving.create_completion(request)
        return [c async for c in chunks]

    chunks = asyncio.run(collect())
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert serving.async_engine.num_in_flight == 0


def test_engine_loop_survives_a_failing_step(serving, monkeypatch):
    engine = serving.async_engine.engine

    def broken_step():
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(engine, "step", broken_step)
    status, body = asyncio.run(serving.respond("/v1/completions", {"prompt": "x", "max_tokens": 4}))
    assert status == 500 and "simulated device failure" in body["error"]["message"]
    monkeypatch.undo()
    status, _ = asyncio.run(serving.respond("/v1/completions", {"prompt": "x", "max_tokens": 4}))
    assert status == 200
    assert serving.async_engine.num_in_flight == 0


def test_stopped_engine_answers_503(serve_llm):
    serving = make_serving(serve_llm)
    status, body = asyncio.run(serving.respond("/v1/completions", {"prompt": "x", "max_tokens": 2}))
    assert status == 503 and body["error"]["code"] == "engine_unavailable"


def test_load_test_script_smoke(server, tmp_path, capsys):
    out = tmp_path / "load.json"
    assert loadtest.main(["--url", server.url, "--concurrency", "1,3", "--requests-per-client", "2",
                          "--max-tokens", "8", "--prompts", "code", "--num-prompts", "4", "--stagger-s", "0.05",
                          "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 3] and report["stagger_s"] == 0.05
    for level in report["levels"]:
        assert level["ok"] == level["requests"] == 2 * level["concurrency"] and level["failed"] == 0
        assert level["output_tokens"] > 0 and level["output_tokens_per_s"] > 0
        assert level["latency_p50_s"] is not None and level["ttft_p50_s"] is not None
    assert "tok/s" in capsys.readouterr().out


def test_load_prompts_and_percentiles(tmp_path):
    assert len(loadtest.load_prompts("code", 10)) == 10
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    assert loadtest.load_prompts(str(path), 5) == ["a", "b"]
    prompts = loadtest.load_prompts("humaneval", 3)  # the set shipped in celeris/data
    assert len(prompts) == 3 and all("def " in p for p in prompts)
    assert loadtest.percentile([], 50) is None
    assert loadtest.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert loadtest.percentile([float(i) for i in range(1, 101)], 95) == 95.0


@pytest.mark.slow
def test_load_test_starts_and_stops_its_own_server_process(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "load.json"
    assert loadtest.main(["--model", str(tiny_checkpoint), "--device", "cpu", "--concurrency", "2",
                          "--requests-per-client", "1", "--max-tokens", "4", "--prompts", "code", "--warmup", "0",
                          "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["levels"][0]["ok"] == 2 and report["url"].startswith("http://127.0.0.1:")
    capsys.readouterr()
    assert loadtest.main(["--model", str(tmp_path / "missing"), "--concurrency", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loadtest: error: the server did not start") and len(err.splitlines()) == 1
    assert loadtest.main(["--url", "http://127.0.0.1:9", "--concurrency", "0"]) == 2  # bad level list


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0"], "--concurrency must list positive integers"),
    (["--concurrency", "two"], "--concurrency must list positive integers"),
    (["--stagger-s", "-1"], "--stagger-s must be a finite number >= 0"),
    (["--stagger-s", "nan"], "--stagger-s must be a finite number >= 0"),
    (["--stagger-s", "inf"], "--stagger-s must be a finite number >= 0"),
])
def test_load_test_rejects_bad_arguments_before_starting_a_server(argv, message, capsys, monkeypatch):
    def no_server(args):
        raise AssertionError("a server was started for bad arguments")

    monkeypatch.setattr(loadtest, "start_server", no_server)
    assert loadtest.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_model_defaults_for_other_rules_are_not_the_callers_settings(serving, serve_llm, monkeypatch):
    """Issue 16 item 3: a generation_config.json default (threshold, cache_refresh, ...) never makes a request that
    picks another rule fail; the same setting sent by the caller is refused naming both, and with its rule chosen
    it is used."""
    for name, value in {"threshold": 0.3, "factor": 2.0, "entropy_bound": 1.0, "draft_source": "lookup",
                        "top_k": 4, "remasking": "margin", "cache_refresh": 2}.items():
        monkeypatch.setitem(serve_llm.generation_config, name, value)
    body = serving.run_sync("/v1/completions", {"prompt": "import os", "max_tokens": 4, "cache": "dual"})
    assert body["choices"][0]["celeris"]["remasking"] == "margin"  # the model's default rule, with its defaults
    with pytest.raises(APIError) as info:
        serving.run_sync("/v1/completions", {"prompt": "import os", "max_tokens": 4, "threshold": 0.3})
    assert info.value.status_code == 400 and info.value.param == "threshold" and "decoding='fixed'" in info.value.message
    one_pass = serving.run_sync("/v1/completions", {"prompt": "import os", "max_tokens": 8, "steps": 8,
                                                    "decoding": "threshold", "threshold": 1e-9})
    assert one_pass["usage"]["nfe"] == 1  # 8 tokens, one block: every position clears the threshold at once


@pytest.mark.parametrize("remasking", ["margin", "entropy"])
def test_dream_confidences_and_top_k_are_request_fields(serving, serve_llm, remasking):
    """Issue 16 item 4 over the serving layer: the same text as LLM.generate with the same settings."""
    body = serving.run_sync("/v1/completions", {"prompt": "import os", "max_tokens": 8, "temperature": 1.0,
                                                "seed": 5, "remasking": remasking, "top_k": 2})
    assert body["choices"][0]["celeris"]["remasking"] == remasking
    want = serve_llm.generate("import os", serve_llm.default_params(max_tokens=8, temperature=1.0, seed=5,
                                                                     remasking=remasking, top_k=2))
    assert body["choices"][0]["text"] == want[0].text


def test_a_default_max_tokens_fits_the_context_in_every_api(serving, serve_llm):
    """Issue 28 item 8: with max_tokens omitted, a prompt that leaves less room than generation_config.json's
    max_tokens (16) gets what fits (128-token context), in completions (each prompt its own) and chat; a prompt
    that fills the context is refused without naming a max_tokens the client never sent."""
    text = "def fibonacci(n):\n    return n\n" * 40
    ids = serve_llm.tokenizer.encode(text)
    long_prompt = serve_llm.tokenizer.decode(ids[:124])
    room = 128 - len(serve_llm.tokenizer.encode(long_prompt))
    assert 1 <= room < 8
    body = serving.run_sync("/v1/completions", {"prompt": [long_prompt, "import os"], "ignore_eos": True})
    # each prompt its own budget: the block is capped at the answer length (8: the folder's block_length)
    assert [c["celeris"]["block_length"] for c in body["choices"]] == [room, 8]
    assert body["usage"]["completion_tokens"] <= room + 16
    lone = serving.run_sync("/v1/completions", {"prompt": long_prompt, "ignore_eos": True})
    assert lone["usage"]["completion_tokens"] <= room
    def chat(k: int) -> tuple[list[dict], int]:
        messages = [{"role": "user", "content": serve_llm.tokenizer.decode(ids[:k])}]
        return messages, len(serve_llm.tokenizer.encode_chat(messages, add_generation_prompt=True))

    messages, rendered = next(chat(k) for k in range(120, 0, -1) if 112 < chat(k)[1] < 128)
    chat = serving.run_sync("/v1/chat/completions", {"messages": messages, "ignore_eos": True})
    assert chat["usage"]["completion_tokens"] <= 128 - rendered
    status, err = asyncio.run(serving.respond("/v1/completions", {"prompt": text}))
    assert status == 400 and err["error"]["code"] == "context_length_exceeded" and err["error"]["param"] == "prompt"
    assert "max_tokens" not in err["error"]["message"] and "128" in err["error"]["message"]
    status, err = asyncio.run(serving.respond("/v1/completions", {"prompt": long_prompt, "max_tokens": 16}))
    assert status == 400 and "max_tokens (16)" in err["error"]["message"]  # a value the client sent still counts
