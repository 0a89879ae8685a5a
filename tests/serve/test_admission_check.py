"""Serving asks the LLM's own admission check (``LLM.check``, the ``check_request`` the engine runs in
``add_request``) and maps a refusal to a 400 naming the parameter in one helper (``parameter_error``)."""

from __future__ import annotations

import pytest

from celeris.sampling.params import SamplingParams
from celeris.serve.errors import parameter_error

CASES = [
    ({}, False),  # the defaults decode
    ({"decoding": "verified"}, False),  # a masked model cannot verify: the engine refuses it
    ({"suffix_window": 4}, True),  # a suffix window with a suffix to infill
    ({"stop_token_ids": [10**6]}, False),  # a stop id outside the vocabulary
]


@pytest.mark.parametrize("settings, has_suffix", CASES)
def test_llm_check_refuses_exactly_what_the_engine_refuses(serve_llm, settings, has_suffix):
    params = serve_llm.default_params(max_tokens=4, **settings)
    suffix_ids = [5] if has_suffix else []
    try:
        serve_llm.check(params, has_suffix)
        checked = None
    except ValueError as exc:
        checked = str(exc)
    try:
        request = serve_llm.engine.add_request([5, 6], params, suffix_ids=suffix_ids)
        admitted = None
        serve_llm.engine.abort(request.request_id)
    except ValueError as exc:
        admitted = str(exc)
    assert checked == admitted
    assert (checked is None) == (settings == {})


def test_parameter_error_names_the_parameter_a_message_starts_with():
    known = {"steps", "top_k", "response_format", "prompt"}
    assert parameter_error(ValueError("steps must be >= 1, got 0"), known).param == "steps"
    assert parameter_error(ValueError("top_k=3 needs temperature > 0"), known).param == "top_k"
    assert parameter_error(ValueError("grammar does not parse"), known, {"grammar": "response_format"}).param \
        == "response_format"
    error = parameter_error(ValueError("the prompt is empty"), known)  # a first word that is no parameter
    assert (error.status_code, error.param) == (400, None)


def test_samplingparams_field_names_are_request_parameters(serve_llm):
    """Every name parameter_error may give is a field a client can send (or SamplingParams' own)."""
    from celeris.serve.protocol import CompletionRequest
    from celeris.serve.serving import _fields

    names = _fields(CompletionRequest(prompt="x"))
    assert {"suffix", "max_tokens", "stop_token_ids"} <= names and "the" not in names
    assert {f for f in SamplingParams.__dataclass_fields__} <= names
