"""`celeris generate --model PATH` and the serving layer of `celeris serve --model PATH` on tiny
checkpoint folders in the published LLaDA and Dream formats."""

from __future__ import annotations

import asyncio
import json

import pytest

from celeris.cli import main
from celeris.serve.serving import OpenAIServing
from tests.models.conftest_formats import write_dream, write_llada

WRITERS = {"llada": write_llada, "dream": write_dream}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def format_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    WRITERS[request.param](folder)
    return folder


def test_cli_generate_on_published_format(format_dir, capsys):
    rc = main(["generate", "def add(a, b):", "--model", str(format_dir), "--json", "--max-new-tokens", "8",
               "--steps", "8", "--block-length", "4", "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    record = json.loads(out.out)
    assert record["nfe"] == 8 and len(record["token_ids"]) <= 8 and "text" in record


def test_cli_threshold_decoding_with_dual_cache(format_dir, capsys):
    rc = main(["generate", "x", "--model", str(format_dir), "--max-new-tokens", "8", "--block-length", "4",
               "--device", "cpu", "--decoding", "threshold", "--cache", "dual", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert json.loads(out.out)["nfe"] >= 2  # at least one step per block


def test_serving_layer_on_published_format(format_dir):
    serving = OpenAIServing.from_model(format_dir, device="cpu", max_num_seqs=2, max_waiting=4)
    serving.start()
    try:
        body = {"prompt": "def add(a, b):", "max_tokens": 8, "steps": 8, "block_length": 4, "seed": 0}
        status, response = asyncio.run(serving.respond("/v1/completions", body))
        assert status == 200, response
        assert response["usage"]["completion_tokens"] <= 8 and response["choices"][0]["finish_reason"]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "steps": 4}
        status, response = asyncio.run(serving.respond("/v1/chat/completions", chat))
        assert status == 200, response
    finally:
        serving.stop()
