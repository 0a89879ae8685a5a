"""`celeris generate --model PATH`, the serving layer of `celeris serve --model PATH` and `celeris bench` on tiny
SDAR and Fast-dLLM v2 folders; their end-of-turn ids and chat-template keyword arguments."""

from __future__ import annotations

import asyncio
import json

import pytest

from celeris.cli import main
from celeris.llm import LLM
from celeris.serve.serving import OpenAIServing
from tests.models.conftest_block_formats import write_fast_dllm, write_sdar

WRITERS = {"sdar": write_sdar, "fast_dllm_v2": write_fast_dllm}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def block_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    WRITERS[request.param](folder)
    return folder


def test_cli_generate_with_the_contract_defaults(block_dir, capsys):
    rc = main(["generate", "def add(a, b):", "--model", str(block_dir), "--json", "--max-new-tokens", "12",
               "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    record = json.loads(out.out)
    contract = LLM(block_dir, device="cpu").model.block_contract
    assert record["block_length"] == contract.defaults["block_length"]
    assert record["decoding"] == contract.defaults["decoding"] and 1 <= record["nfe"] <= 12


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
        body = {"prompt": "def add(a, b):", "max_tokens": 8, "seed": 0, "stop": ["zzz"]}
        status, response = asyncio.run(serving.respond("/v1/completions", body))
        assert status == 200, response
        assert response["usage"]["completion_tokens"] <= 8 and response["choices"][0]["finish_reason"]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": False,
                "chat_template_kwargs": {"enable_thinking": False}}
        status, response = asyncio.run(serving.respond("/v1/chat/completions", chat))
        assert status == 200, response
        status, response = asyncio.run(serving.respond("/v1/completions", body | {"block_length": 3}))
        assert status == 400 and "block_length 3 must divide" in response["error"]["message"]
    finally:
        serving.stop()


def test_end_of_turn_ids_and_enable_thinking(block_dir):
    llm = LLM(block_dir, device="cpu")
    tok = llm.tokenizer
    im_end, eot = tok._tok.token_to_id("<|im_end|>"), tok._tok.token_to_id("<|endoftext|>")
    assert {im_end, eot} <= set(llm.end_token_ids)  # the chat end and the config's end-of-text both end an answer
    assert llm.model.config.mask_token_id not in llm.end_token_ids
    messages = [{"role": "user", "content": "hi"}]
    off = tok.apply_chat_template(messages, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.apply_chat_template(messages).endswith("<|im_start|>assistant\n")
