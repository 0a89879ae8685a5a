"""Every client mistake gets a 4xx in the one OpenAI error shape, naming the parameter; never a 500."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.conftest import CONTEXT, MODEL_NAME

CHAT = [{"role": "user", "content": "hi"}]


def post(server, path: str, body, content_type: str | None = "application/json") -> httpx.Response:
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    headers = {"content-type": content_type} if content_type else {}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=30)


def assert_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
        assert param.split(".")[0].split("[")[0] in body["error"]["message"], body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def test_invalid_json_and_non_object_bodies(server):
    assert_error(post(server, "/v1/completions", "{"), 400, code="invalid_json")
    assert_error(post(server, "/v1/completions", ""), 400, code="invalid_json")
    assert_error(post(server, "/v1/chat/completions", "[1, 2]"), 400, code="invalid_json")
    assert_error(post(server, "/v1/completions", '"prompt"'), 400, code="invalid_json")


def test_wrong_content_type(server):
    assert_error(post(server, "/v1/completions", '{"prompt": "x"}', "text/plain"), 415)
    assert_error(post(server, "/v1/completions", '{"prompt": "x"}', None), 415)
    assert_error(post(server, "/v1/chat/completions", "prompt=x", "application/x-www-form-urlencoded"), 415)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", ""]}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": "2"}, "n"),
    ("/v1/completions", {"prompt": "x", "n": True}, "n"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "seed": -3}, "seed"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "steps": 0}, "steps"),
    ("/v1/completions", {"prompt": "x", "block_length": 0}, "block_length"),
    ("/v1/completions", {"prompt": "x", "remasking": "bogus"}, "remasking"),
    ("/v1/completions", {"prompt": "x", "decoding": "bogus"}, "decoding"),
    ("/v1/completions", {"prompt": "x", "threshold": 2}, "threshold"),
    ("/v1/completions", {"prompt": "x", "cfg_scale": -1}, "cfg_scale"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),  # OpenAI's range [-2, 2]
    ("/v1/chat/completions", {"messages": CHAT, "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "dry_multiplier": -1}, "dry_multiplier"),
    ("/v1/completions", {"prompt": "x", "dry_base": 0.5}, "dry_base"),
    ("/v1/completions", {"prompt": "x", "cache": "bogus"}, "cache"),
    ("/v1/completions", {"prompt": "x", "cache_refresh": -1}, "cache_refresh"),
    ("/v1/completions", {"prompt": "x", "suffix_window": -1}, "suffix_window"),
    ("/v1/completions", {"prompt": "x", "suffix": "y", "suffix_window": 2}, "suffix_window"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream_mode": "denoise"}, "stream_mode"),
    ("/v1/completions", {"prompt": "x", "mystery": 1}, "mystery"),
])
def test_bad_parameters_are_400_naming_the_parameter(server, path, body, param):
    assert_error(post(server, path, body), 400, param=param)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": CHAT, "function_call": "auto"}, "function_call"),
])
def test_unsupported_openai_parameters_are_named(server, path, body, param):
    err = assert_error(post(server, path, body), 400, param=param, code="unsupported_parameter")
    assert "unsupported" in err["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),  # a diffusion model: no likelihood
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 1, "stream": True, "stream_mode": "denoise"}, "logprobs"),
])
def test_bad_logprobs_requests_are_400_naming_the_field(server, path, body, param):
    err = assert_error(post(server, path, body), 400, param=param)
    if param == "echo":
        assert "diffusion" in err["message"] and "causal" in err["message"]


def test_malformed_tools_and_formats_are_400_naming_the_field(server):
    """tools, tool_choice and response_format are supported (tests/serve/test_structured.py); malformed ones
    are refused naming the field."""
    assert_error(post(server, "/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}), 400,
                 param="tools[0].function")
    assert_error(post(server, "/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "yaml"}}), 400,
                 param="response_format.type")
    assert_error(post(server, "/v1/chat/completions", {"messages": CHAT, "tool_choice": "sometimes"}), 400,
                 param="tool_choice")


def test_neutral_values_of_unsupported_parameters_pass(server):
    body = {"messages": CHAT, "max_tokens": 4, "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0,
            "response_format": {"type": "text"}, "tools": [], "user": "u1", "cache": "none"}
    assert post(server, "/v1/chat/completions", body).status_code == 200
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "best_of": 1, "echo": False}).status_code == 200


def test_max_tokens_zero_is_not_treated_as_unset(server):
    assert_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0}), 400, param="max_tokens")
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": None}).status_code == 200


def test_context_length_exceeded_names_both_numbers(server):
    err = assert_error(post(server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": CONTEXT + 7}), 400,
                       code="context_length_exceeded")
    assert str(CONTEXT) in err["message"] and str(CONTEXT + 7) in err["message"]
    long_chat = [{"role": "user", "content": "def f(x): return x\n" * 40}]
    err = assert_error(post(server, "/v1/chat/completions", {"messages": long_chat, "max_tokens": 16}), 400,
                       param="messages", code="context_length_exceeded")
    assert str(CONTEXT) in err["message"]


def test_unknown_model_is_404(server):
    assert_error(post(server, "/v1/completions", {"prompt": "x", "model": "gpt-4"}), 404, param="model",
                 code="model_not_found")
    assert post(server, "/v1/completions", {"prompt": "x", "model": MODEL_NAME, "max_tokens": 2}).status_code == 200


def test_unknown_route_and_wrong_method_use_the_error_shape(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404)
    assert_error(httpx.get(f"{server.url}/v1/completions"), 405)


def test_n_beyond_capacity_is_400_not_429(server):
    assert_error(post(server, "/v1/completions", {"prompt": "x", "n": 64, "max_tokens": 2}), 400, param="n")


@pytest.mark.parametrize("body", [
    "null", "{}", '{"prompt": null}', '{"prompt": {"a": 1}}', '{"prompt": "x", "stop": [null]}',
    '{"prompt": "x", "stream_options": 3}', '{"prompt": "x", "temperature": NaN}', '{"prompt": "\\ud800"}',
    '{"prompt": "x", "seed": 99999999999999999999999}', '{"prompt": "x", "max_tokens": 1e400}',
])
def test_garbage_never_gives_a_server_error(server, body):
    for path in ("/v1/completions", "/v1/chat/completions"):
        resp = post(server, path, body)
        assert 400 <= resp.status_code < 500, (path, body, resp.text)
        assert "error" in resp.json()


DEEP = '{"prompt": ' + "[" * 1000 + "]" * 1000 + "}"  # about 2 KB


@pytest.mark.parametrize("body, fragment", [
    (DEEP, "nested too deeply"),
    ('{"prompt": "x", "max_tokens": ' + "9" * 4301 + "}", "4300 digits"),
    ('{"messages": ' + "[" * 1000 + "]" * 1000 + "}", "nested too deeply"),
])
def test_deep_nesting_and_huge_integers_are_400_not_500(server, body, fragment):
    for path in ("/v1/completions", "/v1/chat/completions"):
        err = assert_error(post(server, path, body), 400, code="invalid_json")
        assert "not valid JSON" in err["message"]
    assert fragment in assert_error(post(server, "/v1/completions", body), 400)["message"]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400", "-1e999"])
@pytest.mark.parametrize("field", ["factor", "entropy_bound", "repetition_penalty", "temperature", "cfg_scale"])
def test_non_finite_numbers_are_refused(server, literal, field):
    """NaN / Infinity are not JSON (RFC 8259), and 1e400 overflows to infinity: all 400, none reach the engine."""
    body = f'{{"prompt": "x", "max_tokens": 2, "{field}": {literal}}}'
    err = assert_error(post(server, "/v1/completions", body), 400, code="invalid_json")
    assert literal.lstrip("-").split("e")[0] in err["message"] or "too large" in err["message"]


@pytest.mark.parametrize("path, body, param, picked", [
    ("/v1/completions", {"prompt": "x", "threshold": 0.2}, "threshold", "decoding='fixed'"),
    ("/v1/completions", {"prompt": "x", "decoding": "threshold", "factor": 2.0}, "factor", "decoding='threshold'"),
    ("/v1/chat/completions", {"messages": CHAT, "entropy_bound": 1.0}, "entropy_bound", "decoding='fixed'"),
    ("/v1/completions", {"prompt": "x", "draft_source": "lookup"}, "draft_source", "decoding='fixed'"),
    ("/v1/completions", {"prompt": "x", "cache": "dual", "cache_refresh": 2}, "cache_refresh", "cache='dual'"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k", "top_k must be"),
    # issue 28 item 4: a value equal to the setting's default counts too
    ("/v1/completions", {"prompt": "x", "threshold": 0.9}, "threshold", "decoding='fixed'"),
    ("/v1/completions", {"prompt": "x", "decoding": "threshold", "factor": 1.0}, "factor", "decoding='threshold'"),
    ("/v1/chat/completions", {"messages": CHAT, "entropy_bound": 0.5}, "entropy_bound", "decoding='fixed'"),
    ("/v1/completions", {"prompt": "x", "draft_source": "lookup_first"}, "draft_source", "decoding='fixed'"),
])
def test_setting_for_a_rule_not_chosen_is_400_naming_both(server, path, body, param, picked):
    """Issue 16 item 3: `threshold` without `decoding: "threshold"` used to be accepted and ignored."""
    err = assert_error(post(server, path, body), 400, param=param)
    assert picked in err["message"]
