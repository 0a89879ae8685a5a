"""`celeris generate --model PATH`, the serving layer of `celeris serve --model PATH` and `celeris bench` on tiny
SDAR and Fast-dLLM v2 folders; their end-of-turn ids and chat-template keyword arguments."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from celeris.cli import main
from celeris.llm import LLM
from celeris.serve.serving import OpenAIServing
from tests.conftest import stop_server
from tests.fixtures.chat_templates import QWEN3
from tests.models.conftest_block_formats import write_fast_dllm, write_llada2, write_sdar

QWEN_WRITERS = {"sdar": write_sdar, "fast_dllm_v2": write_fast_dllm}  # Qwen chat tokenizers (<|im_end|>)
WRITERS = QWEN_WRITERS | {"llada2": write_llada2}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def block_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    WRITERS[request.param](folder)
    return folder


def test_a_shorter_answer_keeps_the_steps_per_block(block_dir):
    """A block model's steps count per block (SDAR, LMDeploy): asking for fewer tokens than the default answer
    length must not scale them down, as it does for a full-attention model's steps per answer."""
    from celeris.cli import _load, build_parser

    llm = LLM(block_dir, device="cpu")
    want = llm.generation_config["steps"]
    assert [llm.default_params(max_tokens=n).steps for n in (4, 16, 64)] == [want] * 3
    _, params = _load(build_parser().parse_args(["generate", "x", "--model", str(block_dir), "--max-tokens", "8"]))
    assert params.steps == want  # the CLI reads them as the loaded model does


def test_cli_generate_with_the_contract_defaults(block_dir, capsys):
    rc = main(["generate", "def add(a, b):", "--model", str(block_dir), "--json", "--max-new-tokens", "12",
               "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    record = json.loads(out.out)
    contract = LLM(block_dir, device="cpu").model.block_contract
    assert record["block_length"] == min(contract.defaults["block_length"], 12)  # the CLI reports the capped block
    # at most one pass per answer position, the last block's padding included (denoised whole, as published)
    assert record["decoding"] == contract.defaults["decoding"] and 1 <= record["nfe"] <= 12 + contract.block_size


@pytest.mark.parametrize("flags, word", [(["--block-length", "3"], "block_length 3 must divide"),
                                         (["--cache", "dual"], "cache 'dual' does not apply"),
                                         (["--cfg-scale", "1"], "cfg_scale")])
def test_cli_refuses_settings_that_do_not_apply(block_dir, capsys, flags, word):
    rc = main(["generate", "x", "--model", str(block_dir), "--max-new-tokens", "8", "--device", "cpu", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and word in err and "Traceback" not in err


def test_serving_layer_on_block_format(block_dir):
    serving = OpenAIServing.from_model(block_dir, device="cpu", max_num_seqs=2, max_waiting=4)
    serving.start()
    try:
        body = {"prompt": "def add(a, b):", "max_tokens": 12, "seed": 0, "ignore_eos": True}
        status, first = asyncio.run(serving.respond("/v1/completions", body))
        assert status == 200, first
        text = first["choices"][0]["text"]
        assert first["usage"]["completion_tokens"] == 12 and first["choices"][0]["finish_reason"] == "length"
        stop = text[3:6]
        assert stop.strip(), text
        status, cut = asyncio.run(serving.respond("/v1/completions", body | {"stop": [stop]}))
        assert status == 200, cut  # a stop string cuts a block model's answer where it first appears
        assert cut["choices"][0]["text"] == text[: text.index(stop)] and cut["choices"][0]["finish_reason"] == "stop"
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": False}
        usage = {}
        for kwargs in (None, {"enable_thinking": False}):
            status, response = asyncio.run(serving.respond("/v1/chat/completions",
                                                            chat | {"chat_template_kwargs": kwargs}))
            assert status == 200, response
            usage[bool(kwargs)] = response["usage"]["prompt_tokens"]
        if block_dir.name.startswith("llada2"):  # Ling's template has no enable_thinking: the same prompt
            assert usage[True] == usage[False]
        else:  # Qwen3's template read enable_thinking=False: an empty think block joins the prompt
            assert usage[True] > usage[False]
        status, response = asyncio.run(serving.respond("/v1/completions", body | {"block_length": 3}))
        assert status == 400 and "block_length 3 must divide" in response["error"]["message"]
        json_chat = chat | {"response_format": {"type": "json_object"}}
        status, response = asyncio.run(serving.respond("/v1/chat/completions", json_chat))
        assert status == 400 and response["error"]["param"] == "response_format", response
        assert "not supported for block-diffusion models" in response["error"]["message"]
    finally:
        serving.stop()


def test_generation_stops_at_the_end_of_turn_token(block_dir):
    """The chat format's end of turn (<|im_end|>; LLaDA2.0's <|role_end|>) ends an answer: a model scripted to
    commit it at the third answer position stops there (finish "stop", fewer passes than ignoring it)."""
    llm = LLM(block_dir, device="cpu")
    name = "<|role_end|>" if block_dir.name.startswith("llada2") else "<|im_end|>"
    end = llm.tokenizer._tok.token_to_id(name)
    assert end in llm.end_token_ids and llm.model.config.mask_token_id not in llm.end_token_ids
    prompt = llm.tokenizer.encode("def add(a, b):")
    at = len(prompt) + 2  # canvas column scripted to score the end of turn highest
    engine, original = llm.engine, llm.model.logits

    def scripted(hidden):
        out = original(hidden).clone()
        (row,) = [r.state for r in engine.block_decoder.requests]  # one request: logits column j scores canvas column s + j
        _, _, s, t = row.unit
        if s <= at < s + out.shape[1]:  # one column when a block's first token is scored alone (commit_first)
            out[0, at - s, end] = 1e4
        return out

    llm.model.logits = scripted
    try:
        done = {}
        for ignore in (False, True):
            request = engine.add_request(prompt, llm.default_params(max_tokens=16, seed=0, ignore_eos=ignore))
            while engine.has_unfinished():
                engine.step()
            done[ignore] = request
    finally:
        del llm.model.logits
    stopped, ignored = done[False], done[True]
    assert ignored.answer.tolist()[2] == end and ignored.finish_reason == "length"
    assert stopped.finish_reason == "stop" and stopped.answer.tolist()[2] == end
    assert stopped.final_prefix() == stopped.answer.tolist()[:2] and stopped.nfe < ignored.nfe
    assert llm.to_output("", stopped).finish_reason == "stop"


@pytest.fixture(scope="module", params=sorted(QWEN_WRITERS))
def qwen_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    QWEN_WRITERS[request.param](folder)
    return folder


def test_end_of_turn_ids_and_enable_thinking(qwen_dir):
    llm = LLM(qwen_dir, device="cpu")
    tok = llm.tokenizer
    im_end, eot = tok._tok.token_to_id("<|im_end|>"), tok._tok.token_to_id("<|endoftext|>")
    assert {im_end, eot} <= set(llm.end_token_ids)  # the chat end and the config's end-of-text both end an answer
    assert llm.model.config.mask_token_id not in llm.end_token_ids
    messages = [{"role": "user", "content": "hi"}]
    off = tok.apply_chat_template(messages, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.apply_chat_template(messages).endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_cli_generate_and_serve_processes_on_block_folders(block_dir):
    """The commands as a user runs them: `celeris generate` and `celeris serve` child processes."""
    import os
    import subprocess
    import sys

    import openai

    from tests.serve.conftest import wait_for_health
    from tests.serve.test_cli_serve import REPO_ROOT, free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run([sys.executable, "-m", "celeris.cli", "generate", "def add(a, b):", "--model",
                           str(block_dir), "--max-new-tokens", "8", "--json"], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["nfe"] >= 1
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "celeris.cli", "serve", "--model", str(block_dir), "--port",
                             str(port), "--max-num-seqs", "2", "--log-level", "warning"], env=env, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="def f(x):", max_tokens=6)
        assert out.usage.completion_tokens <= 6
        pieces = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=6, stream=True))
        assert pieces and pieces[-1].choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError, match="block_length 3 must divide"):
            client.completions.create(model=model, prompt="x", max_tokens=4, extra_body={"block_length": 3})
    finally:
        returncode = stop_server(proc)
    assert returncode == 0


def test_stop_strings_cut_a_block_models_answer(block_dir):
    llm = LLM(block_dir, device="cpu")
    params = llm.default_params(max_tokens=16, seed=0, ignore_eos=True)
    first = llm.generate(["def add(a, b):"], params)[0]
    # a 3-character piece after the start that holds a visible character and first occurs there
    stop = next((first.text[i : i + 3] for i in range(2, len(first.text) - 3)
                 if first.text[i : i + 3].strip() and first.text.find(first.text[i : i + 3]) == i), "")
    assert stop, first.text
    out = llm.generate(["def add(a, b):"], llm.default_params(max_tokens=16, seed=0, ignore_eos=True,
                                                               stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == first.text[: first.text.index(stop)]


def test_cli_chat_second_turn_on_the_published_qwen3_template(tmp_path, monkeypatch, capsys):
    """Issue 28 item 3: SDAR ships Qwen3's template, which reads ``message.tool_calls``; the second turn of
    ``celeris chat`` (an assistant message in the history) renders instead of ending in a traceback."""
    write_sdar(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": QWEN3}))
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nand again\n\n"))
    rc = main(["chat", "--model", str(tmp_path), "--max-new-tokens", "4", "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out.count("model> ") == 2 and "Traceback" not in out.err
