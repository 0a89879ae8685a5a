"""vLLM's tokenizer routes (``celeris.serve.tokenization``): /tokenize, /detokenize, /tokenizer_info, compared with the
tokenizer the completions routes encode with; the API key and the body limit guard them as they guard /v1."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from celeris.serve.app import create_app
from celeris.serve.server import ServerLimits
from tests.serve.conftest import CONTEXT, MODEL_NAME, make_serving

KEY = "sk-tokenize"


@pytest.fixture(scope="module")
def serving(serve_llm):
    return make_serving(serve_llm)


@pytest.fixture(scope="module")
def http(serving):
    app = create_app(serving, api_key=KEY, manage_engine=False, limits=ServerLimits(max_body_bytes=4096))
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def test_tokenize_a_prompt_as_the_completions_route_encodes_it(http, serving):
    text = "def fibonacci(n):\n    return n"
    r = http.post("/tokenize", json={"prompt": text, "model": MODEL_NAME})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == serving.tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == CONTEXT
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert plain["tokens"] == serving.tokenizer.encode(text, add_special_tokens=False)
    assert "".join(plain["token_strs"]) == text


def test_tokenize_messages_with_the_chat_template(http, serving):
    messages = [{"role": "user", "content": "write a stack class"}]
    r = http.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200
    assert r.json()["tokens"] == serving.tokenizer.encode_chat(messages, add_generation_prompt=True)
    bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == serving.tokenizer.encode_chat(messages, add_generation_prompt=False)


def test_detokenize_round_trip_and_a_bad_id(http, serving):
    ids = serving.tokenizer.encode("class Stack:")
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": serving.tokenizer.decode(ids, skip_special_tokens=False)}
    vocab = serving.tokenizer.vocab_size
    bad = http.post("/detokenize", json={"tokens": [5, vocab]})
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == "tokens" and str(vocab) in error["message"] and "tokens[1]" in error["message"]
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400
    assert http.post("/detokenize", json={"tokens": ["a"]}).status_code == 400


def test_tokenizer_info(http, serving):
    info = http.get("/tokenizer_info").json()
    tok = serving.tokenizer
    assert info["eos_token"] == tok.decode([tok.eos_token_id], skip_special_tokens=False)
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == CONTEXT
    assert {"bos_token", "pad_token", "tokenizer_class"} <= set(info)


def test_guards_model_name_key_and_body_limit(http, serving):
    assert http.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404
    assert http.post("/tokenize", json={"prompt": "x", "extra": 1}).status_code == 400
    assert http.post("/tokenize", content=b"[1]", headers={"content-type": "application/json"}).status_code == 400
    for method, path in (("post", "/tokenize"), ("post", "/detokenize"), ("get", "/tokenizer_info")):
        r = getattr(http, method)(path, headers={"Authorization": "Bearer wrong"},
                                  **({"json": {"prompt": "x"}} if method == "post" else {}))
        assert r.status_code == 401, path
    assert http.post("/tokenize", json={"prompt": "x" * 8000}).status_code == 413
