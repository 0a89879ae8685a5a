"""Request models (celeris.serve.protocol) parsed from JSON bodies, without a server."""

from __future__ import annotations

from celeris.serve.protocol import ChatCompletionRequest, CompletionRequest, parse_request


def test_unsupported_params_pass_only_at_neutral_values():
    ok = parse_request(CompletionRequest, '{"prompt": "x", "logprobs": null, "echo": false, "best_of": 1, '
                                          '"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}')
    assert ok.unsupported_params() == []
    bad = parse_request(CompletionRequest, '{"prompt": "x", "logprobs": 0, "echo": true, "top_logprobs": 3, '
                                           '"best_of": 2}')
    assert bad.unsupported_params() == ["top_logprobs", "best_of"]  # logprobs and echo are supported
    chat = parse_request(ChatCompletionRequest, '{"messages": [{"role": "user", "content": "x"}], "functions": '
                                               '[{"name": "f"}], "response_format": {"type": "json_object"}}')
    assert chat.unsupported_params() == ["functions"]  # response_format and tools are supported
    text_format = parse_request(ChatCompletionRequest, '{"messages": [{"role": "user", "content": "x"}], '
                                                      '"response_format": {"type": "text"}, "logprobs": false}')
    assert text_format.unsupported_params() == []
